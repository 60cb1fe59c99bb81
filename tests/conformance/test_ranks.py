"""How ranks and tags may be given, on every engine (checks in checks_ranks.py)."""
from tests.conformance import checks_ranks


def test_integer_like_ranks_and_tags(runner):
    runner.run(checks_ranks.check_integer_like_ranks_and_tags)
