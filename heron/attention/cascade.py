"""Which decoding sequences share a cached prefix, and whether reading it once for them pays (cascade attention).

The decoding sequences of a step: all of a pure decode step's, or the one-token rows of a mixed step (decode
rows beside new prompts' chunks, the steady state of a job that admits prompts as others finish); a prompt
chunk is never a member.

Prefix caching gives sequences with a common prompt prefix the same physical blocks, so the grouping is read off
the block tables alone: sequences whose tables start with the same block id form a candidate group, each member's
match is how many leading block ids it has in common with the group's first member, and the group takes the
prefix length k (in blocks) that saves the most reads, (members whose match >= k, less one) x k, leaving the
members that match less to the plain kernel. A shared block id is shared K/V: a block is written only by the
sequence that holds it alone (copy-on-write), and only full blocks strictly before a member's last key count,
so every member keeps at least one key of its own (the suffix pass never runs empty).

The decision never loses (docs/kernels.md, "Cascade"): a step groups only when
  - a group has at least MIN_GROUP members and a prefix of at least MIN_PREFIX_BLOCKS blocks: below that its
    per-member partials (written and read back, PREFIX_PARTS x H x D float32 each, ~2 blocks' K/V for
    Qwen3-8B) cost about what it saves;
  - the step saves at least MIN_SAVED_BYTES of K/V reads a layer: the prefix pass is one more launch a layer
    (~3-4 us with its tail, ~16 MB at the H200's ~4 TB/s), so a step must save twice that.
Otherwise the step runs the plain decode kernel and pays nothing.

Host work is O(batch x prefix blocks) numpy a step plus a Python loop over the groups (at most batch /
MIN_GROUP), never over tokens. The plan is written into one int32 array of fixed layout, [kv_start (max
seqs) | tile_len (max tiles) | tile_members (max tiles x tile_seqs)], that the backend copies to a device
buffer of the same layout: a captured decode graph reads it at fixed addresses.
"""

from __future__ import annotations

import numpy as np
import torch

from heron.attention.backend import AttentionMetadata

MIN_GROUP = 4
MIN_PREFIX_BLOCKS = 4
MIN_SAVED_BYTES = 32 << 20


class CascadePlanner:
    """Plans a decode step's cascade: its groups, and their packed int32 array (above)."""

    def __init__(
        self,
        max_num_seqs: int,
        tile_seqs: int,
        block_size: int,
        kv_bytes_per_token: int,
        *,
        min_group: int | None = None,
        min_prefix_blocks: int | None = None,
        min_saved_bytes: int | None = None,
    ) -> None:
        # the thresholds: the module's (read when built), smaller in tests of tiny batches
        self.min_group = MIN_GROUP if min_group is None else min_group
        self.min_prefix_blocks = MIN_PREFIX_BLOCKS if min_prefix_blocks is None else min_prefix_blocks
        self.min_saved_bytes = MIN_SAVED_BYTES if min_saved_bytes is None else min_saved_bytes
        self.max_num_seqs = max_num_seqs
        self.tile_seqs = tile_seqs
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token  # K and V of one token in one layer
        self.max_tiles_total = self.max_tiles(max_num_seqs)
        self.size = max_num_seqs + self.max_tiles_total * (1 + tile_seqs)

    def max_tiles(self, batch: int) -> int:
        """Tiles a batch of `batch` sequences can need: ceil(batch / tile_seqs) full tiles plus one partial tile
        per group, and there are at most batch // MIN_GROUP groups. Fixes the prefix kernel's grid for a
        captured batch size."""
        return -(-batch // self.tile_seqs) + batch // self.min_group

    def views(self, packed: np.ndarray | object, batch: int) -> tuple[object, object, object]:
        """(kv_start [batch], tile_len [max_tiles(batch)], tile_members [max_tiles(batch), tile_seqs]) of a
        packed array (numpy or torch), at offsets that depend on the limits only."""
        n, t_max, t = self.max_num_seqs, self.max_tiles_total, self.max_tiles(batch)
        members = packed[n + t_max :].reshape(t_max, self.tile_seqs)
        return packed[:batch], packed[n : n + t], members[:t]

    def groups(self, block_tables: np.ndarray, seq_lens: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """The step's groups worth running as a cascade: (member sequences, prefix blocks) each; [] when the
        step should run the plain kernel. block_tables [B, >= blocks used] int32, seq_lens [B] (0: a padded row)."""
        usable = (seq_lens.astype(np.int64) - 1) // self.block_size  # full blocks before each last key
        cand = np.flatnonzero(usable >= self.min_prefix_blocks)
        if len(cand) < self.min_group:
            return []
        _, first_of, group_of, counts = np.unique(
            block_tables[cand, 0], return_index=True, return_inverse=True, return_counts=True
        )
        if counts.max() < self.min_group:  # (sequences with prompts of their own: the common case ends here)
            return []
        usable = usable[cand]
        tables = block_tables[cand, : int(usable.max())]
        leader = first_of[group_of.reshape(-1)]
        diff = tables != tables[leader]
        match = np.where(diff.any(1), diff.argmax(1), tables.shape[1])
        match = np.minimum(match, np.minimum(usable, usable[leader]))  # past a length the table holds junk
        out, saved = [], 0
        for g in np.flatnonzero(counts >= self.min_group).tolist():
            members = np.flatnonzero(group_of.reshape(-1) == g)
            m = members[np.argsort(-match[members], kind="stable")]
            k_of_j = match[m]  # the prefix j + 1 members can share: the (j + 1)-th longest match
            gain = np.arange(len(m)) * k_of_j
            gain[: self.min_group - 1] = 0
            gain[k_of_j < self.min_prefix_blocks] = 0
            j = int(gain.argmax())
            if gain[j] > 0:
                out.append((cand[m[: j + 1]], int(k_of_j[j])))
                saved += int(gain[j])
        if saved * self.block_size * self.kv_bytes_per_token < self.min_saved_bytes:
            return []
        return out

    def write(self, packed: np.ndarray, batch: int, groups: list[tuple[np.ndarray, int]]) -> None:
        """Write `groups` into `packed` for a batch of `batch` rows: each group's members in tiles of tile_seqs,
        their kv_start its prefix length in keys; tiles past the last used are emptied."""
        kv_start, tile_len, tile_members = self.views(packed, batch)
        kv_start[:] = 0
        tile_len[:] = 0
        tile_members[:] = -1
        t = 0
        for members, blocks in groups:
            keys = blocks * self.block_size
            kv_start[members] = keys
            for i in range(0, len(members), self.tile_seqs):
                chunk = members[i : i + self.tile_seqs]
                tile_len[t] = keys
                tile_members[t, : len(chunk)] = chunk
                t += 1


class CascadeBuffers:
    """A backend's cascade state: the planner; the packed plan in two pinned host arrays used in turn (a step's
    copy may still be queued when the next step is planned: the engine reads a step back before planning the
    one after next) and in the device buffer the kernels read; the prefix partials [max seqs, H, parts, D] and
    [max seqs, H, parts] float32. All allocated once, so captured graphs keep their addresses."""

    def __init__(
        self, planner: CascadePlanner, num_heads: int, head_dim: int, parts: int, device: torch.device
    ) -> None:
        self.planner = planner
        pin = device.type == "cuda"
        self.host = [torch.zeros(planner.size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.device_plan = torch.zeros(planner.size, dtype=torch.int32, device=device)
        n = planner.max_num_seqs
        self.partials = (
            torch.empty(n, num_heads, parts, head_dim, dtype=torch.float32, device=device),
            torch.empty(n, num_heads, parts, dtype=torch.float32, device=device),
        )

    def plan(self, meta: AttentionMetadata, force: bool) -> bool:
        """Plan the decode rows of the step of `meta` (host tables and lengths only) and queue the plan's copy
        to the device; `force`: even without a group (a graph captured with the cascade kernels replays).
        Returns whether the step runs the cascade kernels."""
        b = meta.num_seqs
        if meta.block_tables_cpu is None or b < self.planner.min_group:
            return False
        seq_lens = meta.seq_lens_cpu[:b].numpy()
        if meta.max_query_len > 1:  # a mixed step: its prompt chunks' rows are in no group (length 0 here)
            qsl = meta.query_start_loc_cpu[: b + 1].numpy()
            seq_lens = np.where(qsl[1:] - qsl[:-1] == 1, seq_lens, 0)
        groups = self.planner.groups(meta.block_tables_cpu[:b].numpy(), seq_lens)
        if not groups and not force:
            return False
        self.host.reverse()
        self.planner.write(self.host[0].numpy(), b, groups)
        self.device_plan.copy_(self.host[0], non_blocking=True)
        return True

    def inputs(self, batch: int):
        """The kernels' views for a batch of `batch` rows: kv_start, tile_len, tile_members, (out, lse)."""
        kv_start, tile_len, members = self.planner.views(self.device_plan, batch)
        o, lse = self.partials
        return kv_start, tile_len, members, (o[:batch], lse[:batch])
