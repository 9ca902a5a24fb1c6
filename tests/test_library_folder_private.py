"""The library cache folder (codegen/build/library_cache.py) is refused as the kernel cache
folder is when others may write to it: a BACKPLAN_LIBRARY_CACHE_DIR of mode 777, or a
`library` entry of the cache folder linked to a shared folder; made fresh, it is 0700."""

import os
import stat

import pytest

from backplan.codegen.build import library_cache
from backplan.codegen.build.cache_signing import CacheError


def test_a_library_folder_others_can_write_to_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("BACKPLAN_LIBRARY_CACHE_DIR", str(shared))
    with pytest.raises(CacheError, match="library cache folder .* writable by other users"):
        library_cache.library_folder()


def test_a_library_link_into_a_shared_folder_is_refused(tmp_path, monkeypatch):
    cache, shared = tmp_path / "cache", tmp_path / "shared"
    cache.mkdir(mode=0o700)
    shared.mkdir()
    shared.chmod(0o777)
    os.symlink(shared, cache / library_cache.FOLDER)
    monkeypatch.delenv("BACKPLAN_LIBRARY_CACHE_DIR", raising=False)
    monkeypatch.setenv("BACKPLAN_CACHE_DIR", str(cache))
    with pytest.raises(CacheError, match="library cache folder"):
        library_cache.library_folder()


def test_a_new_library_folder_is_made_private(tmp_path, monkeypatch):
    folder = tmp_path / "lib"
    monkeypatch.setenv("BACKPLAN_LIBRARY_CACHE_DIR", str(folder))
    assert library_cache.library_folder() == str(folder)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
