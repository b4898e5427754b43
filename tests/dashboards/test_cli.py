"""`kvscope dashboard`: argument defaults and the error for a run it cannot read."""

from __future__ import annotations

from kvscope import cli


def test_binds_to_localhost_by_default():
    args = cli.build_parser().parse_args(["dashboard", "runs/a", "runs/b"])
    assert (args.host, args.port, args.runs, args.jaeger_url) == (
        "127.0.0.1", 8050, ["runs/a", "runs/b"], None)


def test_unreadable_run_exits_2_naming_it(tmp_path, capsys):
    assert cli.main(["dashboard", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "kvscope dashboard: cannot read run" in err and str(tmp_path / "nope") in err


def test_jaeger_url_must_be_http(synthetic_runs, capsys):
    assert cli.main(["dashboard", str(synthetic_runs[0]), "--jaeger-url", "javascript:x"]) == 2
    assert "must start with http" in capsys.readouterr().err
