"""`drop_user_site_hooks`: a carried user site-packages keeps its packages but loses what runs at Python start."""

from __future__ import annotations

from agentrl.hub.interop.harbor_verifier import drop_user_site_hooks


def test_start_up_hooks_of_a_user_site_are_removed_and_nothing_else(tmp_path):
    home = tmp_path / "home"
    site = home / ".local" / "lib" / "python3.11" / "site-packages"
    planted = ["usercustomize.py", "usercustomize.cpython-311.pyc", "sitecustomize.py", "zz-agentrl.pth",
               "sitecustomize/__init__.py"]
    kept = ["requests/__init__.py", "requests-2.0.dist-info/METADATA", "custom.py"]
    elsewhere = ["usr/lib/python3/dist-packages/distutils-precedence.pth", "project/usercustomize.py"]
    for relative in planted + kept:
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_text("x")
    for relative in elsewhere:
        (home / relative).parent.mkdir(parents=True, exist_ok=True)
        (home / relative).write_text("x")
    removed = drop_user_site_hooks(home, "/root/")
    prefix = "/root/.local/lib/python3.11/site-packages/"
    assert sorted(removed) == sorted(prefix + name for name in
                                     ["usercustomize.py", "usercustomize.cpython-311.pyc", "sitecustomize.py",
                                      "zz-agentrl.pth", "sitecustomize"])
    assert not any((site / relative).exists() for relative in planted)
    assert all((site / relative).exists() for relative in kept) and all((home / r).exists() for r in elsewhere)
    # the same folder carried as ~/.local itself
    (site / "again.pth").write_text("x")
    assert drop_user_site_hooks(home / ".local", "/root/.local") == [prefix + "again.pth"]
