"""The ``cases`` and ``shrink`` subcommands, driven through argparse like parity's CLI will."""

import argparse
import json

from cases import Case
from cases.commands import add_parsers, describe
from cases.suites import load_suite


def parser(**kw):
    p = argparse.ArgumentParser(prog="dsv4-parity")
    add_parsers(p.add_subparsers(dest="command", required=True), **kw)
    return p


def run(argv, capsys, **kw):
    args = parser(**kw).parse_args(argv)
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cases_json_lists_the_suite(capsys):
    rc, out, _ = run(["cases", "--suite", "smoke", "--json"], capsys)
    assert rc == 0
    assert [Case.from_dict(d) for d in json.loads(out)] == load_suite("smoke")


def test_cases_text_and_coverage(capsys):
    rc, out, _ = run(["cases", "--suite", "smoke"], capsys)
    assert rc == 0 and out.count("\n") == len(load_suite("smoke")) + 1
    assert describe(load_suite("smoke")[0]) in out
    rc, out, _ = run(["cases", "--suite", "gate", "--coverage"], capsys)
    assert rc == 0 and "required cells" in out and "MISSING" not in out
    rc, out, _ = run(["cases", "--suite", "smoke", "--coverage", "--json"], capsys)
    table = json.loads(out)
    assert rc == 0 and all(row["count"] > 0 for row in table["required"])


def test_unknown_suite_is_a_clean_error(capsys):
    rc, _, err = run(["cases", "--suite", "nope"], capsys)
    assert rc == 2 and "unknown suite 'nope'" in err


def test_shrink_uses_the_injected_predicate(capsys):
    seen = []

    def factory(args):
        seen.append(args.case_id)
        return lambda case: case.is_thd and case.layout.num_real_rows >= 3

    case = next(c for c in load_suite("smoke") if c.is_thd and c.layout.num_real_rows >= 3)
    rc, out, err = run(["shrink", "--case-id", case.id, "--suite", "smoke"], capsys, predicate_factory=factory)
    assert rc == 0 and seen == [case.id]
    repro = out.strip()
    assert repro.startswith("dsv4-parity run --case ")
    small = Case.from_json(repro.split("--case ", 1)[1].strip("'"))
    assert small.layout.num_real_rows == 3 and "predicate calls" in err
    assert "dsv4-parity run --case" not in err  # the repro is printed once, on stdout


def test_shrink_without_a_predicate_or_with_a_bad_case(capsys):
    rc, _, err = run(["shrink", "--case-id", load_suite("smoke")[0].id, "--suite", "smoke"], capsys)
    assert rc == 2 and "no failure predicate" in err
    rc, _, err = run(["shrink", "--case", '{"config": {}}'], capsys, predicate_factory=lambda a: bool)
    assert rc == 2 and "layout: missing required field" in err
    rc, _, err = run(["shrink", "--case-id", "abc"], capsys, predicate_factory=lambda a: bool)
    assert rc == 2 and "--suite" in err
