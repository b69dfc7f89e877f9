# Shared set-up for scripts/test and .ci/package: uv on PATH, torch's find-links handed to uv.
# Sourced, not run.

if ! command -v uv >/dev/null 2>&1; then
    echo "==> installing uv" >&2
    python3 -m pip install --quiet uv
fi

# uv does not read pip's configuration; on machines whose pip is configured with
# find-links holding a CPU build of torch, hand uv the same links so a sync never
# downloads a multi-GB CUDA build.
if [ -z "${UV_FIND_LINKS:-}" ]; then
    links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
    [ -n "$links" ] && export UV_FIND_LINKS="$links"
fi

export AGL_CACHE_DIR="${AGL_CACHE_DIR:-$HOME/.cache/agl}"
