"""End-to-end examples, importable so that `fastt demo` can run them (`examples/` at the repository root runs
them as scripts)."""
