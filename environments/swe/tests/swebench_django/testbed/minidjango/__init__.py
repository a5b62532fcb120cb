"""minidjango: a tiny Django-shaped package for agentrl's SWE-bench grading tests."""
