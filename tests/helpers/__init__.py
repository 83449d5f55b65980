"""What the tests share, never a test itself: pytest puts tests/ on sys.path (pyproject.toml's
`pythonpath`), so a test imports `from helpers.jobs import run_job`. No test module imports another."""
