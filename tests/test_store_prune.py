"""A local store prunes the directories its deletes empty; puts racing those prunes (a fresh
lease directory created while its parent is being removed) still succeed."""

from __future__ import annotations

import threading
import time
import uuid

from ckptstore import Store


def test_puts_racing_the_pruning_of_their_parent_directories_succeed(tmp_path):
    store = Store(tmp_path)
    errors: list[BaseException] = []
    puts = [0]
    stop = threading.Event()

    def putter() -> None:
        while not stop.is_set():
            try:
                store.put(f"leases/save/{uuid.uuid4().hex}/0.json", b"x")
                puts[0] += 1
            except Exception as exc:  # noqa: BLE001 - counted and asserted below
                errors.append(exc)

    def cleaner() -> None:  # empties leases/save again and again, so it is pruned
        while not stop.is_set():
            for key in store.list("leases/save"):
                store.delete(key)

    threads = [threading.Thread(target=f) for f in (putter, putter, cleaner)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert puts[0] > 50 and errors == []
    for key in store.list("leases"):
        store.delete(key)
    assert list(tmp_path.iterdir()) == []
