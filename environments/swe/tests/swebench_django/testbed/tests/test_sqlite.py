"""Settings module named by `--settings=test_sqlite` (as Django's own test suite has)."""

DATABASES = {"default": {"ENGINE": "sqlite3", "NAME": ":memory:"}}
