"""Huge pages asked for under an engine's parameters (``_hugepages``): the 2 MiB-aligned
inside of each large CPU storage, once per storage; nothing where the kernel does not offer
them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from asyncslab.engines import _hugepages
from asyncslab.engines._hugepages import HUGE_PAGE, advise_huge_pages, huge_pages_offered


def _vma_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCSLAB_HUGE_PAGES", "1")


def _kernel_offers() -> bool:
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _kernel_offers(),
    reason="this kernel offers no huge pages",
)
@pytest.mark.usefixtures("asked")
def test_a_large_storage_is_advised_once_and_its_mapping_takes_huge_pages() -> None:
    assert huge_pages_offered()
    big = torch.empty(9 * HUGE_PAGE, dtype=torch.uint8)
    small = torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)
    advised = advise_huge_pages([big, big[HUGE_PAGE:], small])
    start = big.data_ptr()
    inside = (start + 9 * HUGE_PAGE) // HUGE_PAGE * HUGE_PAGE - (-(-start // HUGE_PAGE) * HUGE_PAGE)
    assert advised == inside >= 8 * HUGE_PAGE
    middle = -(-start // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    flags = _vma_flags(middle)
    assert "hg" in flags.get("VmFlags", "").split(), flags


@pytest.mark.usefixtures("asked")
def test_nothing_is_advised_where_huge_pages_are_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    off = tmp_path / "enabled"
    off.write_text("always madvise [never]\n")
    monkeypatch.setattr(_hugepages, "_ENABLED", off)
    assert not huge_pages_offered()
    assert advise_huge_pages([torch.empty(9 * HUGE_PAGE, dtype=torch.uint8)]) == 0


@pytest.mark.parametrize("setting", [None, "0", "yes"])
def test_they_are_asked_for_only_with_the_environment_set_to_1(
    monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    if setting is None:
        monkeypatch.delenv("ASYNCSLAB_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("ASYNCSLAB_HUGE_PAGES", setting)
    assert not huge_pages_offered()
    assert advise_huge_pages([torch.empty(9 * HUGE_PAGE, dtype=torch.uint8)]) == 0


@pytest.mark.usefixtures("asked")
def test_meta_and_small_tensors_are_left_alone() -> None:
    assert advise_huge_pages([torch.empty(HUGE_PAGE * 4, device="meta")]) == 0
    assert advise_huge_pages([torch.empty(16)]) == 0
    assert sys.platform.startswith("linux") or not huge_pages_offered()
