"""agl's terminal while the embedded default sends other output to its log (:mod:`agl_trainer.terminal`).

Each test runs a short script in a fresh interpreter with its stdout and stderr in files, since the
module points the process's file descriptors 1 and 2 elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

_PRELUDE = """\
import logging, os, subprocess, sys, warnings
from pathlib import Path
from agl_trainer.terminal import quiet_terminal, send_output_to, terminal
log = Path(sys.argv[1])
"""


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    log: str


def run_script(tmp_path: Path, body: str) -> Ran:
    script = tmp_path / "script.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    log = tmp_path / "trainer.log"
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        code = subprocess.run(
            [sys.executable, str(script), str(log)], stdout=stdout, stderr=stderr, timeout=60, check=False
        ).returncode
    return Ran(code, out.read_text(), err.read_text(), log.read_text() if log.exists() else "")


def test_third_party_output_goes_to_the_log_and_agls_lines_to_the_terminal(tmp_path: Path) -> None:
    ran = run_script(
        tmp_path,
        """
        with quiet_terminal():
            logging.basicConfig()  # as verl does when imported
            warnings.warn("engine is not available")
            print("held before the log existed")
            send_output_to(log)
            print("a library's print")
            os.write(2, b"a C extension's write\\n")
            subprocess.run(["echo", "a child process"], check=True)
            logging.getLogger("verl.platform").warning("No supported accelerator detected")
            print("agl: start line", file=terminal().out)
            print("agl: log line", file=terminal().err)
        print("after the block")
        """,
    )
    assert ran.code == 0, ran.stderr
    assert ran.stdout == "agl: start line\nafter the block\n"
    assert ran.stderr == "agl: log line\n"
    for noise in (
        "UserWarning: engine is not available",
        "held before the log existed",
        "a library's print",
        "a C extension's write",
        "a child process",
        "No supported accelerator detected",
    ):
        assert noise in ran.log


def test_error_records_of_any_logger_reach_the_terminal_and_the_log(tmp_path: Path) -> None:
    ran = run_script(
        tmp_path,
        """
        ray = logging.getLogger("ray")  # Ray's own handler, not propagating to the root
        ray.addHandler(logging.StreamHandler())
        ray.propagate = False
        logging.basicConfig()
        with quiet_terminal():
            send_output_to(log)
            ray.warning("a warning of Ray")
            ray.error("a worker died")
            logging.getLogger("torch").error("an error of torch")
        """,
    )
    assert ran.code == 0, ran.stderr
    assert [line.split(" ", 1)[1] for line in ran.stderr.splitlines()] == [
        "ERROR ray: a worker died",
        "ERROR torch: an error of torch",
    ]
    assert "a warning of Ray" in ran.log and "a worker died" in ran.log and "an error of torch" in ran.log


def test_an_unexpected_error_before_the_log_shows_what_was_held_before_its_traceback(tmp_path: Path) -> None:
    ran = run_script(
        tmp_path,
        """
        with quiet_terminal():
            print("what led up to it")
            raise RuntimeError("a bug")
        """,
    )
    assert ran.code == 1
    assert ran.stderr.startswith("what led up to it\nTraceback (most recent call last):")
    assert ran.stderr.splitlines()[-1] == "RuntimeError: a bug"


def test_agls_one_line_error_before_the_log_drops_what_was_held(tmp_path: Path) -> None:
    ran = run_script(
        tmp_path,
        """
        with quiet_terminal():
            warnings.warn("engine is not available")
            print("agl-trainer: a bad key", file=terminal().err)
            raise SystemExit(2)
        """,
    )
    assert (ran.code, ran.stdout, ran.stderr) == (2, "", "agl-trainer: a bad key\n")


def test_ctrl_c_before_the_log_drops_what_was_held(tmp_path: Path) -> None:
    ran = run_script(
        tmp_path,
        """
        try:
            with quiet_terminal():
                warnings.warn("engine is not available")
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            print("agl-trainer: interrupted", file=sys.stderr)
        """,
    )
    assert (ran.code, ran.stdout, ran.stderr) == (0, "", "agl-trainer: interrupted\n")


def test_an_error_after_the_log_keeps_its_traceback_on_the_terminal(tmp_path: Path) -> None:
    ran = run_script(
        tmp_path,
        """
        with quiet_terminal():
            send_output_to(log)
            print("a library's print")
            raise RuntimeError("a bug")
        """,
    )
    assert ran.code == 1
    assert ran.stderr.startswith("Traceback (most recent call last):")
    assert "a library's print" not in ran.stderr
    assert ran.log == "a library's print\n"


def test_without_quiet_terminal_nothing_is_redirected(tmp_path: Path) -> None:
    ran = run_script(
        tmp_path,
        """
        assert not send_output_to(log)
        print("a library's print")
        print("agl: line", file=terminal().err)
        """,
    )
    assert (ran.code, ran.stdout, ran.stderr, ran.log) == (0, "a library's print\n", "agl: line\n", "")
