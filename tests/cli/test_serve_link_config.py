"""dist_nce.cli.serve_link reads its Serve config as the jobs read theirs: a key given twice is refused."""
from __future__ import annotations

from dist_nce.cli.serve_link import main


def test_a_serve_config_with_a_key_given_twice_is_refused_before_anything_starts(tmp_path, capsys):
    config = tmp_path / "link.yaml"
    config.write_text("applications:\n  - name: link\n    args: {run: runs/a}\n    args: {run: runs/b}\n")
    assert main([str(config)]) == 2
    assert f"error: {config}:4: duplicate key 'applications[0].args' (first at line 3)" in capsys.readouterr().err
