"""The ``cases`` and ``shrink`` subcommands, driven through their argparse half (:mod:`cli.cases_command`)."""

import argparse
import json

from cases import Case
from cli import cases_command
from cli.cases_command import add_parsers, describe
from cases.suites import load_suite


def parser():
    p = argparse.ArgumentParser(prog="dsv4-parity")
    add_parsers(p.add_subparsers(dest="command", required=True))
    return p


def run(argv, capsys):
    args = parser().parse_args(argv)
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


def test_shrink_uses_its_predicate(capsys, monkeypatch):
    seen = []

    def predicate(args, case):
        seen.append(case.id)
        return lambda c: c.is_thd and c.layout.num_real_rows >= 3

    monkeypatch.setattr(cases_command, "shrink_predicate", predicate)
    case = next(c for c in load_suite("smoke") if c.is_thd and c.layout.num_real_rows >= 3)
    rc, out, err = run(["shrink", "--case-id", case.id, "--suite", "smoke"], capsys)
    assert rc == 0 and seen == [case.id]
    repro = out.strip()
    assert repro.startswith("dsv4-parity run --case ")
    small = Case.from_json(repro.split("--case ", 1)[1].strip("'"))
    assert small.layout.num_real_rows == 3 and "predicate calls" in err
    assert "dsv4-parity run --case" not in err  # the repro is printed once, on stdout


def test_shrink_with_a_bad_case(capsys):
    rc, _, err = run(["shrink", "--case", '{"config": {}}'], capsys)
    assert rc == 2 and "layout: missing required field" in err
    rc, _, err = run(["shrink", "--case-id", "abc"], capsys)
    assert rc == 2 and "--suite" in err
