"""The commit a results file records is read from ``.git`` by hand: a plain checkout and a ``git worktree``
checkout (whose ``.git`` is a file) each name their own commit, and a folder outside git none."""

from pathlib import Path

import pytest

from nanollm.cli.provenance import head_commit

MAIN, BRANCH, DETACHED = "a" * 40, "b" * 40, "c" * 40


def repository(tmp_path: Path) -> Path:
    """A repository's ``.git`` as git lays it out: HEAD on main (a loose ref), a branch only in packed-refs,
    and the folder of one worktree."""
    git = tmp_path / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(MAIN + "\n")
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{BRANCH} refs/heads/feature\n")
    (git / "worktrees" / "wt").mkdir(parents=True)
    (git / "worktrees" / "wt" / "commondir").write_text("../..\n")
    return git.parent


def worktree(tmp_path: Path, head: str) -> Path:
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".git").write_text("gitdir: ../repo/.git/worktrees/wt\n")             # relative, as git may write it
    (tmp_path / "repo" / ".git" / "worktrees" / "wt" / "HEAD").write_text(head + "\n")
    return wt


def test_a_plain_checkout_names_its_branch_s_commit(tmp_path):
    assert head_commit(repository(tmp_path)) == MAIN


def test_a_worktree_names_its_own_branch_s_commit_from_the_shared_refs(tmp_path):
    repository(tmp_path)
    assert head_commit(worktree(tmp_path, "ref: refs/heads/feature")) == BRANCH


def test_a_worktree_finds_a_loose_ref_in_the_shared_folder(tmp_path):
    repo = repository(tmp_path)
    (repo / ".git" / "refs" / "heads" / "topic").write_text(DETACHED + "\n")
    assert head_commit(worktree(tmp_path, "ref: refs/heads/topic")) == DETACHED


def test_a_worktree_on_a_detached_head_names_it(tmp_path):
    repository(tmp_path)
    assert head_commit(worktree(tmp_path, DETACHED)) == DETACHED


def test_a_folder_outside_git_names_none(tmp_path):
    assert head_commit(tmp_path) is None


def test_this_checkout_names_a_commit():
    if not (Path(__file__).resolve().parents[3] / ".git").exists():
        pytest.skip("not a git checkout: a copy of the tree without .git")
    commit = head_commit()
    assert commit is not None and len(commit) == 40 and int(commit, 16) >= 0
