"""`agentrl trainer-plan`: layout and memory estimate from the command line, one-line errors."""

from __future__ import annotations

from agentrl.cli import main


def test_trainer_plan_prints_layout_and_memory(capsys):
    assert main(["trainer-plan", "glm-4.5-air", "--gpus", "32", "--row-tokens", "32768"]) == 0
    out = capsys.readouterr().out
    assert "106.85B parameters" in out
    assert "dp=32 cp=1 ep=32" in out
    assert "states" in out and "activations" in out and "total" in out


def test_trainer_plan_cp_auto_and_bad_degrees(capsys):
    assert main(["trainer-plan", "glm-4.5-air", "--gpus", "16", "--row-tokens", "131072", "--cp", "auto"]) == 0
    assert "dp=2 cp=8 ep=16" in capsys.readouterr().out  # the smallest cp whose estimate fits 139 GiB
    assert main(["trainer-plan", "glm-4.5-air", "--gpus", "6", "--ep", "4"]) == 2
    assert "must divide the world size (6)" in capsys.readouterr().err
    assert main(["trainer-plan", "glm-4.5-air", "--ep", "many"]) == 2
    assert "--ep 'many': expected a positive integer or 'auto'" in capsys.readouterr().err
