# Shared set-up for scripts/test and .ci/package: uv on PATH, torch's find-links handed to uv,
# and the check that a venv holds the CPU build of torch. Sourced, not run.

if ! command -v uv >/dev/null 2>&1; then
    echo "==> installing uv" >&2
    python3 -m pip install --quiet uv
fi

# uv does not read pip's configuration; on machines whose pip is configured with
# find-links holding a CPU build of torch, hand uv the same links so a sync never
# downloads a multi-GB CUDA build. pip separates them by spaces or newlines, uv by commas.
if [ -z "${UV_FIND_LINKS:-}" ]; then
    links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
    links="$(tr -s ' \t\n' ',' <<<"$links" | sed 's/^,//; s/,$//')"
    [ -n "$links" ] && export UV_FIND_LINKS="$links"
fi

# The same cache root as agl_trainer.local.envs.cache_dir.
export AGL_CACHE_DIR="${AGL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/agl}"

# require_cpu_torch VENV WHAT: exit unless VENV's torch (if any) is the CPU build, wherever that
# build is expected: under CI, and wherever find-links (which carry it here) are set.
require_cpu_torch() {
    [ "${CI:-}" = true ] || [ -n "${UV_FIND_LINKS:-}" ] || return 0
    local torch
    torch="$(uv pip list --quiet --python "$1/bin/python" --format freeze | grep -i '^torch==' || true)"
    if [ -n "$torch" ] && [[ "$torch" != *+cpu ]]; then
        echo "$2 holds $torch, not the CPU build torch==2.13.0+cpu: uv found no CPU wheel" \
            "(UV_FIND_LINKS='${UV_FIND_LINKS:-}', UV_EXTRA_INDEX_URL='${UV_EXTRA_INDEX_URL:-}');" \
            "see README, \"torch\"" >&2
        exit 1
    fi
}

# set_find_links WHEELS: the array find_links, uv's --find-links for WHEELS and for each of
# UV_FIND_LINKS' links (a --find-links on uv's command line replaces UV_FIND_LINKS, a
# comma-separated list, rather than adding to it).
set_find_links() {
    local link links
    find_links=(--find-links "$1")
    IFS=, read -ra links <<<"${UV_FIND_LINKS:-}"
    for link in "${links[@]}"; do find_links+=(--find-links "$link"); done
}
