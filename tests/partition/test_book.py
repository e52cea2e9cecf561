"""The partition book: owners and rows of global ids, a request split by owner in request order,
nodes added while serving, and the .npz round trip (a damaged or foreign file is named)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quiver_serve.partition.book import PartitionBook, PartitionBookError


def book() -> PartitionBook:
    # owners 0 1 0 2 1 1: partition 0 holds ids 0, 2; 1 holds 1, 4, 5; 2 holds 3
    return PartitionBook(owner=np.array([0, 1, 0, 2, 1, 1]), local=np.array([0, 0, 1, 0, 1, 2]),
                         num_parts=3, method="hash")


def test_owners_rows_and_split_keep_request_order() -> None:
    b = book()
    ids = np.array([5, 0, 3, 1, 2, 5])
    assert b.owners(ids).tolist() == [1, 0, 2, 1, 0, 1]
    assert b.locals(ids).tolist() == [2, 0, 0, 0, 1, 2]
    split = b.split(ids)
    assert [s.tolist() for s in split] == [[1, 4], [0, 3, 5], [2]]
    assert b.global_ids(1).tolist() == [1, 4, 5]
    assert b.sizes().tolist() == [2, 3, 1]
    assert [s.tolist() for s in b.split(np.array([], dtype=np.int64))] == [[], [], []]


@pytest.mark.parametrize("ids", [[6], [-1], [0, 7, 99]])
def test_ids_outside_the_graph_are_named(ids: list[int]) -> None:
    with pytest.raises(ValueError, match=rf"node ids \[{ids[-1] if len(ids) == 1 else 7}"):
        book().owners(np.array(ids))


def test_float_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="node ids must be integers"):
        book().split(np.array([0.5]))


def test_added_nodes_take_the_next_ids_and_rows() -> None:
    b = book()
    new = b.add_nodes(3, 2)
    assert new.tolist() == [6, 7, 8]
    assert b.num_nodes == 9 and b.owners(new).tolist() == [2, 2, 2]
    assert b.locals(new).tolist() == [1, 2, 3]
    more = b.add_nodes(2000, 0)  # past the first buffer's room
    assert more[0] == 9 and b.num_nodes == 2009
    assert b.locals(more[-1:]).tolist() == [2001]
    assert b.global_ids(2).tolist() == [3, 6, 7, 8]
    with pytest.raises(ValueError, match="partition 3 is not in"):
        b.add_nodes(1, 3)
    with pytest.raises(ValueError, match="count must be an integer >= 0"):
        b.add_nodes(-1, 0)


def test_round_trip_after_added_nodes(tmp_path: Path) -> None:
    b = book()
    b.add_nodes(4, 1)
    b.save(tmp_path / "book.npz")
    again = PartitionBook.load(tmp_path / "book.npz")
    assert np.array_equal(again.owner, b.owner) and np.array_equal(again.local, b.local)
    assert (again.num_parts, again.method) == (3, "hash")


@pytest.mark.parametrize(("owner", "local", "parts", "message"), [
    ([0, 1], [0, 0], 0, "num_parts must be an integer >= 1"),
    ([0, 2], [0, 0], 2, "owner holds partitions outside"),
    ([0, 0], [0, 0], 1, "share a \\(partition, local row\\)"),
    ([0, 0], [0, 2], 1, "local rows must be in"),
    ([0, 1, 1], [0, 0], 2, "one length"),
])
def test_inconsistent_books_are_refused(owner: list[int], local: list[int], parts: int,
                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PartitionBook(owner=np.array(owner), local=np.array(local), num_parts=parts,
                      method="hash")


def test_a_damaged_or_foreign_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "book.npz"
    np.savez(path, owner=np.array([0, 1]))
    with pytest.raises(PartitionBookError, match=r"book.npz: not a partition book"):
        PartitionBook.load(path)
    np.savez(path, owner=np.array([0, 5]), local=np.array([0, 0]), num_parts=2, method="hash")
    with pytest.raises(PartitionBookError, match=r"book.npz: owner holds partitions outside"):
        PartitionBook.load(path)
    path.write_bytes(b"not a zip")
    with pytest.raises(PartitionBookError, match=r"book.npz: cannot read"):
        PartitionBook.load(path)
    np.savez(path, owner=np.array([object()], dtype=object), local=np.array([0]), num_parts=1,
             method="hash")
    with pytest.raises(PartitionBookError, match=r"book.npz"):
        PartitionBook.load(path)  # no pickle
