"""Restore Keras checkpoints from the nearest copy of the newest one: the framework's half of
:mod:`sparkhvd.checkpoint.nearest_copy` (which decides what is read from where).

Rank 0 writes the checkpoint and keeps its files (model and optimizer) on its host. After a
relaunch that puts rank 0 on another host, a rank that landed on the old one sends them: with
Horovod to rank 0, the one that loads (and broadcasts the weights, as always); with
``tf.distribute`` to every worker (each loads the same files). Bytes travel as uint8 tensors on
Horovod, and on the strategy as an all-reduce in which only the sender's values are not zero
(it has no broadcast of its own): exact, at twice a broadcast's traffic.
"""
from __future__ import annotations

import json
from typing import Any, Optional

__side__ = "rank"

#: Bytes per collective when a host copy is sent to the ranks that lack it.
CHUNK = 64 << 20


class HorovodCollectives:
    """:class:`sparkhvd.checkpoint.nearest_copy.Collectives` on Horovod (``horovod.tensorflow``)."""

    def __init__(self, collectives: Any) -> None:
        self.hvd = collectives
        self.size = int(collectives.size())

    def gather(self, held: dict[str, Any]) -> list[dict[str, Any]]:
        return list(self.hvd.allgather_object(held))

    def broadcast_record(self, record: Optional[dict], source: int) -> Optional[dict]:
        return self.hvd.broadcast_object(record, root_rank=source)

    def broadcast_bytes(self, data: Optional[bytes], source: int, rank: int
                        ) -> Optional[bytes]:
        import numpy as np
        import tensorflow as tf

        n = int(self.hvd.broadcast_object(len(data) if data is not None else -1,
                                          root_rank=source))
        if n < 0:
            return None
        mine = np.frombuffer(data, dtype=np.uint8) if rank == source and data else None
        pieces = []
        for start in range(0, n, CHUNK):
            part = mine[start:start + CHUNK] if mine is not None else \
                np.zeros(min(CHUNK, n - start), dtype=np.uint8)
            pieces.append(self.hvd.broadcast(tf.constant(part), root_rank=source).numpy())
        return data if rank == source else b"".join(p.tobytes() for p in pieces)

    def everyone(self, ok: bool) -> bool:
        import tensorflow as tf

        failed = self.hvd.allreduce(tf.constant([int(not ok)], tf.int32), op=self.hvd.Sum)
        return int(failed.numpy()[0]) == 0


class StrategyCollectives:
    """:class:`sparkhvd.checkpoint.nearest_copy.Collectives` on a ``tf.distribute`` strategy
    (MultiWorkerMirroredStrategy: one replica a worker): every message is a summed int32
    vector in which only its sender's part is not zero."""

    def __init__(self, strategy: Any, rank: int) -> None:
        self.strategy, self.rank = strategy, rank
        self.size = int(strategy.num_replicas_in_sync)
        self._summed: Any = None

    def summed(self, values: Any) -> Any:
        """``values`` (int32, 1-D, the same length on every worker) summed over the workers:
        one traced function for every message (an eager collective costs far more)."""
        import tensorflow as tf

        if self._summed is None:
            strategy = self.strategy

            @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
            def summed(part: Any) -> Any:
                return strategy.reduce(tf.distribute.ReduceOp.SUM,
                                       strategy.run(tf.identity, args=(part,)), axis=None)

            self._summed = summed
        return self._summed(tf.constant(values, tf.int32)).numpy()

    def _sizes(self, mine: int) -> list[int]:
        """Every worker's ``mine`` (>= -1), by rank: each as two int32 words of 31 bits (a
        file past 2 GiB does not fit one), in a slot only its worker fills."""
        import numpy as np

        slots = np.zeros(2 * self.size, dtype=np.int32)
        value = mine + 1
        slots[2 * self.rank:2 * self.rank + 2] = (value >> 31, value & 0x7FFFFFFF)
        summed = [int(v) for v in self.summed(slots)]
        return [(summed[2 * r] << 31 | summed[2 * r + 1]) - 1 for r in range(self.size)]

    def _words(self, data: Optional[bytes], n: int) -> bytes:
        """``n`` bytes that are ``data`` on its sender and zeros elsewhere, summed in int32
        words (the last padded)."""
        import numpy as np

        words = (n + 3) // 4
        mine = np.frombuffer((data or b"").ljust(words * 4, b"\0"), dtype=np.int32) \
            if data is not None else None
        out = bytearray()
        step = CHUNK // 4
        for start in range(0, words, step):
            part = mine[start:start + step] if mine is not None else \
                np.zeros(min(step, words - start), dtype=np.int32)
            out += self.summed(part).astype(np.int32).tobytes()
        return bytes(out[:n])

    def gather(self, held: dict[str, Any]) -> list[dict[str, Any]]:
        text = json.dumps(held, sort_keys=True).encode()
        sizes = self._sizes(len(text))
        before, total = sum(sizes[:self.rank]), sum(sizes)
        everyone = self._words(bytes(before) + text + bytes(total - before - len(text)), total)
        found, start = [], 0
        for size in sizes:
            found.append(json.loads(everyone[start:start + size]))
            start += size
        return found

    def broadcast_record(self, record: Optional[dict], source: int) -> Optional[dict]:
        data = json.dumps(record).encode() if self.rank == source else None
        return json.loads(self.broadcast_bytes(data, source, self.rank) or b"null")

    def broadcast_bytes(self, data: Optional[bytes], source: int, rank: int
                        ) -> Optional[bytes]:
        n = self._sizes(len(data) if rank == source and data is not None else -1)[source]
        if n < 0:
            return None
        sent = self._words(data if rank == source else None, n)
        return data if rank == source else sent

    def everyone(self, ok: bool) -> bool:
        import numpy as np

        return int(self.summed(np.array([int(not ok)], dtype=np.int32))[0]) == 0
