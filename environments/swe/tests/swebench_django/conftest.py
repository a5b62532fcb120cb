"""The tiny Django-style project of the SWE-bench grading tests: built into an image, never collected here."""

collect_ignore = ["testbed"]
