"""The commit a GPU result names is the commit that ran: the stamp written before a device call counts only
where the tree that ran matches it (2026-11-27: bench.json named aa8ce2d, dirty, for a run of 6d8fe72, from a
stale .git on the GPU machine)."""

import json

import hopperlm.provenance as prov


def test_the_tree_digest_follows_code_files_only(tmp_path):
    (tmp_path / "hopperlm").mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "hopperlm" / "a.py").write_text("x = 1\n")
    first = prov.tree_digest(tmp_path)
    (tmp_path / "bench" / "results" / "out.py").write_text("numbers")  # outputs, not code
    (tmp_path / "hopperlm" / "__pycache__").mkdir()
    (tmp_path / "hopperlm" / "__pycache__" / "a.py").write_text("cache")
    (tmp_path / "hopperlm" / "notes.txt").write_text("not code")
    assert prov.tree_digest(tmp_path) == first
    (tmp_path / "hopperlm" / "a.py").write_text("x = 2\n")
    assert prov.tree_digest(tmp_path) != first


def test_a_matching_stamp_names_the_commit_and_a_stale_one_says_so(tmp_path, monkeypatch):
    stamp = tmp_path / "gpu-carry" / "stamp.json"
    monkeypatch.setattr(prov, "STAMP", stamp)
    monkeypatch.setattr(prov, "REPO", tmp_path)
    monkeypatch.setattr(prov, "git_commit", lambda: ("aa8ce2d", True))  # what a stale .git would say
    assert prov.commit_of_this_tree()["commit_source"] == "git"  # no stamp: git, as on a dev machine
    stamp.parent.mkdir()
    stamp.write_text(json.dumps({"commit": "6d8fe72", "dirty": False, "tree": prov.tree_digest()}))
    assert prov.commit_of_this_tree() == {
        "commit": "6d8fe72",
        "dirty": False,
        "commit_source": "stamp, tree verified",
    }
    stamp.write_text(json.dumps({"commit": "6d8fe72", "dirty": False, "tree": "0" * 16}))
    stale = prov.commit_of_this_tree()
    assert stale["commit"] == "aa8ce2d" and stale["dirty"] is True
    assert "unverified" in stale["commit_source"] and "gpu_carry.sh --stamp" in stale["commit_source"]
    assert prov.provenance("x")["commit_source"] == stale["commit_source"]  # every benchmark record says it
