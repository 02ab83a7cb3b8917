#!/usr/bin/env bash
# Set up .venv/ (once) and run the main job or the tests. Usage: scripts/dev.sh demo|test|test-all [args...]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
if [ ! -x .venv/bin/fastt ] || [ pyproject.toml -nt .venv/.installed ] || [ constraints.txt -nt .venv/.installed ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  # constraints.txt pins torch 2.13.0 (the CPU wheel on local disk); a newer torch would pull a CUDA build.
  .venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]' 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import fastt, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  touch .venv/.installed
fi
cmd="${1:-demo}"; shift || true
case "$cmd" in
  demo) exec .venv/bin/fastt demo "$@" ;;
  test|test-all)
    .venv/bin/ruff check --quiet .  # lint first: a style error fails in seconds, not after the suite
    # test (what CI runs): every test but those marked slow, the larger copies of a check that a smaller one in
    # the suite already makes (more models, more ranks, more schedules): 26 minutes on 2 cores (1542 s, a fresh clone).
    # test-all: those too (2333 s here, quiet). Either runs each benchmark at its small size.
    marks=(); [ "$cmd" = test ] && marks=(-m "not slow")
    exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=60 ${marks[@]+"${marks[@]}"} "$@" ;;
  *) echo "usage: scripts/dev.sh demo|test|test-all [args...]" >&2; exit 2 ;;
esac
