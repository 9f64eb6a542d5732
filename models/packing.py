"""Padding-free packing: sequences concatenated into one row up to a token budget.

Each sequence keeps the position ids it would have alone (computed from its own image grid by
the family adapter), so packing never changes a token's positions; attention is block-diagonal
by sequence. Row 0 of the (4, 1, L) position ids restarts at 0 for every sequence, which is how
the attention implementation finds the boundaries (`cu_seqlens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from data.batch import Batch


@dataclass(frozen=True)
class HostLayout:
    """A packed row's boundaries and patch grids as Python ints, taken while its tensors are on the host.

    A forward on the device reads these rather than the tensors: reading a device tensor back waits for
    everything queued on the device, which then idles while the host queues the next kernels.
    """

    cu_seqlens: tuple[int, ...]
    cu_seqlens_k: tuple[int, ...] | None = None
    image_grid: tuple[tuple[int, ...], ...] | None = None  # image_grid_thw's rows
    video_grid: tuple[tuple[int, ...], ...] | None = None  # video_grid_thw's rows
    # the row's token ids (1, L) on the host: the forward counts its placeholders here, not on the device
    input_ids: torch.Tensor | None = field(default=None, compare=False, repr=False)


def _host_values(t: torch.Tensor | None):
    """A host tensor's values as (nested) tuples of ints; None for none."""
    if t is None:
        return None
    values = t.tolist()
    return tuple(tuple(v) for v in values) if t.dim() == 2 else tuple(values)


@dataclass
class PackedMicrobatch:
    """One packed row and where its scored tokens sit.

    target_positions[k] is the row position whose logits predict target_ids[k]; target_seq[k] is
    the index (within `sample_indices`) of the sequence that token belongs to.
    """

    input_ids: torch.Tensor  # (1, L)
    position_ids: torch.Tensor  # (4, 1, L)
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    cu_seqlens: torch.Tensor  # (S + 1,)
    target_positions: torch.Tensor  # (K,)
    target_ids: torch.Tensor  # (K,)
    target_seq: torch.Tensor  # (K,)
    sample_indices: list[int]
    # Which distinct image group (a sample's pixel tensor, possibly several images) each sequence
    # uses, -1 for text-only: the G responses of a prompt share one group, so the vision tower
    # runs once per prompt. pixel_values/image_grid_thw hold the distinct groups only. A sequence
    # with tool images (a multi-turn episode) takes two entries, in row order: its prompt's group,
    # then its own tool images' group.
    image_group: list[int] | None = None
    images_per_group: list[int] | None = None  # grid rows (images) in each distinct group
    # Videos likewise: the distinct video groups (a prompt's videos, shared by its responses), the
    # group each sequence with videos takes in row order (-1: none), and videos per group.
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_group: list[int] | None = None
    videos_per_group: list[int] | None = None
    # Per-target values riding with this micro-batch through a step (grpo/update.py's PackedStep):
    # name → (K,) tensor on the micro-batch's device, in target order.
    fields: dict = field(default_factory=dict)
    # MoE routing replay: the experts the engine chose for each token of the row, (L, layers, k).
    routed_experts: torch.Tensor | None = None
    # Shared prompts (`pack(..., share_prompts=True)`): the row holds a prompt's tokens once, then each of
    # its responses; `cu_seqlens` then bounds query segments (a prompt, a response, or a whole unshared
    # sequence), and segment s attends to the row positions kv_index[cu_seqlens_k[s]:cu_seqlens_k[s + 1]]
    # (a response: its prompt's, then its own), causally aligned at the end. None: segments are sequences.
    kv_index: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    # The same boundaries and grids as Python ints (`host_layout`), carried through `to`.
    host: HostLayout | None = None
    # The vision feature streams of this micro-batch's distinct image and video groups, computed for the whole
    # pass at once (models.policy.Policy.pass_vision; model.vision_once), in the order the family's
    # `image_features` returns them; the forward takes them instead of running the tower. [] for a micro-batch
    # without images in such a pass (the pass ran the tower's collectives); None: the forward runs the tower.
    vision: list | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_targets(self) -> int:
        return self.target_ids.numel()

    def attention_pairs(self) -> int:
        """Query-key pairs the row's attention covers, a segment of q queries over k keys counting q·k (an
        unshared sequence of s tokens: s², the FLOP count's convention)."""
        host = self.host_layout()
        if host is not None:
            q = [b - a for a, b in zip(host.cu_seqlens[:-1], host.cu_seqlens[1:])]
            k = q if host.cu_seqlens_k is None else [b - a for a, b in zip(host.cu_seqlens_k[:-1],
                                                                            host.cu_seqlens_k[1:])]
            return sum(x * y for x, y in zip(q, k))
        q = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        k = q if self.cu_seqlens_k is None else (self.cu_seqlens_k[1:] - self.cu_seqlens_k[:-1]).long()
        return int((q * k).sum())

    def host_layout(self) -> HostLayout | None:
        """The row's boundaries and patch grids as Python ints, and its token ids on the host: those kept from
        when the micro-batch was on the host, or read now from tensors still there; None for a micro-batch
        made on the device."""
        if self.host is not None:
            return self.host
        tensors = (self.cu_seqlens, self.cu_seqlens_k, self.image_grid_thw, self.video_grid_thw)
        if any(t is not None and t.device.type != "cpu" for t in (*tensors, self.input_ids)):
            return None
        return HostLayout(*(_host_values(t) for t in tensors), input_ids=self.input_ids)

    def to(self, device) -> "PackedMicrobatch":
        """The micro-batch on `device`, its host layout kept. Copies from the host to a GPU are queued
        without waiting for the GPU (a blocking copy waits for its queue to drain first); the packer's tensors
        are ordinary (pageable) host memory, which CUDA has copied out by the time the call returns."""
        device = torch.device(device)

        def move(t):
            if t is None:
                return None
            return t.to(device, non_blocking=t.device.type == "cpu" and device.type == "cuda")

        return PackedMicrobatch(
            move(self.input_ids), move(self.position_ids), move(self.pixel_values), move(self.image_grid_thw),
            move(self.cu_seqlens), move(self.target_positions), move(self.target_ids), move(self.target_seq),
            list(self.sample_indices), self.image_group, self.images_per_group,
            pixel_values_videos=move(self.pixel_values_videos), video_grid_thw=move(self.video_grid_thw),
            video_group=self.video_group, videos_per_group=self.videos_per_group,
            routed_experts=move(self.routed_experts), kv_index=move(self.kv_index),
            cu_seqlens_k=move(self.cu_seqlens_k), host=self.host_layout(), vision=self.vision,
        )


def first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Bins of sample indices, each at most `max_tokens` long (a longer sample gets a bin of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def balanced_bins(lengths: list[int], num_bins: int) -> list[list[int]]:
    """Exactly `num_bins` bins with balanced token totals (longest first onto the lightest bin)."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = min(range(num_bins), key=lambda k: loads[k])
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def grouped_bins(lengths: list[int], groups: list, num_bins: int, max_tokens: int) -> list[list[int]]:
    """Exactly `num_bins` bins filled in turn, each up to the mean load, keeping the samples of one
    group (one image: the G responses of a prompt) together, so each image's vision forward runs in
    as few micro-batches as possible. A bin may overflow `max_tokens`; the caller checks."""
    first: dict = {}
    for i, g in enumerate(groups):
        first.setdefault(g, i)
    order = sorted(range(len(lengths)), key=lambda i: (first[groups[i]], -lengths[i]))
    target = sum(lengths) / max(num_bins, 1)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    b = 0
    for i in order:
        while b < num_bins - 1 and bins[b] and (loads[b] >= target or loads[b] + lengths[i] > max_tokens):
            b += 1
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(x) for x in bins]


def plan_microbatches(lengths: list[int], max_tokens: int, num_bins: int | None = None) -> list[list[int]]:
    """Micro-batches as lists of sample indices.

    Without `num_bins`: the fewest bins first-fit-decreasing finds. With it (ranks agree on a
    common count so every rank runs the same number of forwards): that many balanced bins, some
    possibly empty. Bins hold indices in ascending order so packing is deterministic.
    """
    if num_bins is None:
        return [sorted(b) for b in first_fit_decreasing(lengths, max_tokens)]
    return balanced_bins(lengths, num_bins)


def bins_fit(bins: list[list[int]], lengths: list[int], max_tokens: int) -> bool:
    return all(len(b) <= 1 or sum(lengths[i] for i in b) <= max_tokens for b in bins)


def pack(batch: Batch, indices: list[int], share_prompts: bool = False) -> PackedMicrobatch:
    """Concatenate the given samples into one row (`share_prompts`: each shared prompt once, `pack_shared`).

    The batch needs `input_ids` (1-D per sample), `position_ids` ((4, L) per sample), `loss_mask`
    (1-D per sample, 1 where the token is scored), and optionally `pixel_values` and
    `image_grid_thw` (None for text-only samples), an episode's own images after its prompt's,
    `tool_pixel_values` and `tool_image_grid_thw` (None where it has none), the prompt's videos,
    `pixel_values_videos` and `video_grid_thw` (None where it has none), and for MoE routing replay
    `routed_experts` ((L, layers, k) per sample).
    """
    sub = batch.slice(indices)
    if share_prompts and "routed_experts" not in sub:
        return pack_shared(sub, list(indices))
    ids, pos, masks = sub["input_ids"].items, sub["position_ids"].items, sub["loss_mask"].items
    lengths = [t.numel() for t in ids]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    target_positions, target_ids, target_seq = [], [], []
    for s, (seq, mask) in enumerate(zip(ids, masks)):
        scored = torch.nonzero(mask[1:].bool(), as_tuple=False).flatten() + 1
        target_positions.append(scored - 1 + offsets[s])
        target_ids.append(seq[scored])
        target_seq.append(torch.full_like(scored, s))
    pixels, grids, groups = _distinct_images(sub)
    vpixels, vgrids, vgroups = _distinct_videos(sub)
    return PackedMicrobatch(
        input_ids=torch.cat(ids).unsqueeze(0),
        position_ids=torch.cat(pos, dim=1).unsqueeze(1),
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32),
        target_positions=torch.cat(target_positions),
        target_ids=torch.cat(target_ids),
        target_seq=torch.cat(target_seq),
        sample_indices=list(indices),
        image_group=groups,
        images_per_group=[g.shape[0] for g in grids],
        pixel_values_videos=torch.cat(vpixels) if vpixels else None,
        video_grid_thw=torch.cat(vgrids) if vgrids else None,
        video_group=vgroups,
        videos_per_group=[g.shape[0] for g in vgrids],
        routed_experts=torch.cat(sub["routed_experts"].items) if "routed_experts" in sub else None,
    )


def _distinct_videos(sub: Batch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Pixel/grid tensors of the distinct video groups (by tensor identity: a prompt's responses share
    one) and the group each sequence takes, -1 where it has no video."""
    if "pixel_values_videos" not in sub:
        return [], [], [-1] * len(sub)
    seen: dict[int, int] = {}
    pixels, grids, groups = [], [], []
    for pix, grid in zip(sub["pixel_values_videos"].items, sub["video_grid_thw"].items):
        if pix is None:
            groups.append(-1)
            continue
        if id(pix) not in seen:
            seen[id(pix)] = len(pixels)
            pixels.append(pix)
            grids.append(grid)
        groups.append(seen[id(pix)])
    return pixels, grids, groups


def image_groups(batch: Batch) -> list:
    """A key per sample: samples sharing one image tensor (a prompt's responses) share a key, the
    identity `_distinct_images` dedups by; each text-only sample is a group of its own."""
    if "pixel_values" not in batch:
        return list(range(len(batch)))
    videos = batch["pixel_values_videos"].items if "pixel_values_videos" in batch else [None] * len(batch)
    return [("image", id(p)) if p is not None else ("video", id(v)) if v is not None else ("text", i)
            for i, (p, v) in enumerate(zip(batch["pixel_values"].items, videos))]


def _distinct_images(sub: Batch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Pixel/grid tensors of the distinct image groups (by tensor identity) and the groups the row's
    image placeholders take, in row order.

    Without tool images that is one group per sequence (-1 for text-only). An episode with tool
    images (`tool_pixel_values`) takes its prompt's group, shared with the prompt's other episodes,
    then a group of its own: the prompt's images are encoded once per micro-batch, each episode's
    tool images once.
    """
    if "pixel_values" not in sub:
        return [], [], [-1] * len(sub)
    tools = sub["tool_pixel_values"].items if "tool_pixel_values" in sub else [None] * len(sub)
    tool_grids = sub["tool_image_grid_thw"].items if "tool_pixel_values" in sub else [None] * len(sub)
    seen: dict[int, int] = {}
    pixels, grids, groups = [], [], []
    for pix, grid, tpix, tgrid in zip(sub["pixel_values"].items, sub["image_grid_thw"].items, tools, tool_grids):
        for p, g in ((pix, grid), (tpix, tgrid)):
            if p is None:
                continue
            if id(p) not in seen:
                seen[id(p)] = len(pixels)
                pixels.append(p)
                grids.append(g)
            groups.append(seen[id(p)])
        if pix is None and tpix is None:
            groups.append(-1)
    return pixels, grids, groups


# --- shared prompts -------------------------------------------------------------------------------------------
def prompt_groups(batch: Batch) -> list[tuple[list[int], int]]:
    """The batch's samples as (members, shared prefix length) groups, in order of first appearance.

    Samples share a prefix when they share their prompt's pixel tensor (a prompt's responses do, by
    identity) or, text-only, their ids before their first scored token, and their ids and positions agree
    up to it; the prefix stops at the first scored token of any member, so every member keeps at least one
    token of its own after it. A group of one, or a prefix of 0, shares nothing."""
    ids, pos, masks = batch["input_ids"].items, batch["position_ids"].items, batch["loss_mask"].items
    first_scored = [int(torch.nonzero(m).min()) if bool(m.any()) else t.numel() for t, m in zip(ids, masks)]
    members: dict = {}
    for i, key in enumerate(image_groups(batch)):
        if key[0] == "text":  # no media to share by identity: the prompt's own ids
            key = ("text", tuple(ids[i][:first_scored[i]].tolist()))
        members.setdefault(key, []).append(i)
    out = []
    for group in members.values():
        first = [first_scored[i] for i in group]
        prefix = min(first) if len(group) > 1 else 0
        lead = group[0]
        for i in group[1:]:
            if prefix == 0:
                break
            if torch.equal(ids[i][:prefix], ids[lead][:prefix]) and torch.equal(pos[i][:, :prefix],
                                                                                pos[lead][:, :prefix]):
                continue  # the whole prefix agrees (a prompt's responses): two comparisons, no mask
            same = (ids[i][:prefix] == ids[lead][:prefix]) & (pos[i][:, :prefix] == pos[lead][:, :prefix]).all(0)
            prefix = prefix if bool(same.all()) else int(torch.nonzero(~same).min())
        out.append((group, prefix))
    return out


def shared_row_tokens(bin_: list[int], lengths: list[int], prefix_of: list[int], group_of: list[int]) -> int:
    """Tokens of the row `pack_shared` builds for these samples: each group's prefix once where two or more
    of its members share the bin (a lower bound of what the bin's own members share)."""
    present: dict[int, int] = {}
    for i in bin_:
        present[group_of[i]] = present.get(group_of[i], 0) + 1
    return sum(lengths[i] - (prefix_of[i] if present[group_of[i]] > 1 else 0) for i in bin_) + sum(
        next(prefix_of[i] for i in bin_ if group_of[i] == g) for g, n in present.items() if n > 1)


def pack_shared(sub: Batch, indices: list[int]) -> PackedMicrobatch:
    """`pack` with each shared prompt once: the row holds a group's prefix, then each member's remaining
    tokens, and attention runs per segment (`kv_index`, `cu_seqlens_k`): the prefix causally over itself, a
    member's tokens over the prefix and causally over their own. The same logprobs as `pack`, with a prompt's
    tokens (its image's among them) computed once for all its responses."""
    ids, pos, masks = sub["input_ids"].items, sub["position_ids"].items, sub["loss_mask"].items
    n = len(ids)
    tools = sub["tool_pixel_values"].items if "tool_pixel_values" in sub else [None] * n
    tool_grids = sub["tool_image_grid_thw"].items if "tool_pixel_values" in sub else [None] * n
    prompt_pix = sub["pixel_values"].items if "pixel_values" in sub else [None] * n
    prompt_grid = sub["image_grid_thw"].items if "pixel_values" in sub else [None] * n
    videos = sub["pixel_values_videos"].items if "pixel_values_videos" in sub else [None] * n
    video_grids = sub["video_grid_thw"].items if "pixel_values_videos" in sub else [None] * n
    row_ids, row_pos, seg_lengths, kv_parts, key_lengths = [], [], [0], [], [0]
    target_positions, target_ids, target_seq = [], [], []
    image_items: list[tuple[torch.Tensor, torch.Tensor]] = []
    image_group, video_items, video_group = [], [], []
    seen_images: dict[int, int] = {}
    seen_videos: dict[int, int] = {}
    length = 0

    def image_slot(pix, grid) -> int:
        if id(pix) not in seen_images:
            seen_images[id(pix)] = len(image_items)
            image_items.append((pix, grid))
        return seen_images[id(pix)]

    def prompt_media(s: int) -> None:  # sample s's prompt images and videos, in row order
        if prompt_pix[s] is not None:
            image_group.append(image_slot(prompt_pix[s], prompt_grid[s]))
        if videos[s] is not None:
            if id(videos[s]) not in seen_videos:
                seen_videos[id(videos[s])] = len(video_items)
                video_items.append((videos[s], video_grids[s]))
            video_group.append(seen_videos[id(videos[s])])

    def segment(tokens: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor]) -> int:
        nonlocal length
        start = length
        if tokens.numel() == 0:  # a member with nothing after the prefix (no model tokens): no segment
            return start
        row_ids.append(tokens)
        row_pos.append(positions)
        length += tokens.numel()
        seg_lengths.append(length)
        kv_parts.extend([*keys, torch.arange(start, length)])
        key_lengths.append(key_lengths[-1] + sum(k.numel() for k in keys) + tokens.numel())
        return start

    for members, prefix in prompt_groups(sub):
        shared = prefix > 0 and len(members) > 1
        lead = members[0]
        if shared:
            base = segment(ids[lead][:prefix], pos[lead][:, :prefix], [])
            head = [torch.arange(base, base + prefix)]
            prompt_media(lead)
        for s in members:
            cut = prefix if shared else 0
            start = segment(ids[s][cut:], pos[s][:, cut:], head if shared else [])
            if not shared:
                prompt_media(s)
            if tools[s] is not None:
                image_group.append(image_slot(tools[s], tool_grids[s]))
            scored = torch.nonzero(masks[s][1:].bool(), as_tuple=False).flatten() + 1
            before = scored - 1  # the position whose logits predict each scored token
            in_prefix = before < cut
            rows = torch.where(in_prefix, before + (base if shared else 0), before - cut + start)
            target_positions.append(rows)
            target_ids.append(ids[s][scored])
            target_seq.append(torch.full_like(scored, s))
    seq = torch.cat(target_seq)
    order = torch.sort(seq, stable=True).indices  # targets in sample order, as `pack` gives them
    return PackedMicrobatch(
        input_ids=torch.cat(row_ids).unsqueeze(0),
        position_ids=torch.cat(row_pos, dim=1).unsqueeze(1),
        pixel_values=torch.cat([p for p, _ in image_items]) if image_items else None,
        image_grid_thw=torch.cat([g for _, g in image_items]) if image_items else None,
        cu_seqlens=torch.tensor(seg_lengths, dtype=torch.int32),
        target_positions=torch.cat(target_positions)[order],
        target_ids=torch.cat(target_ids)[order],
        target_seq=seq[order],
        sample_indices=list(indices),
        image_group=image_group or [-1] * n,
        images_per_group=[g.shape[0] for _, g in image_items],
        pixel_values_videos=torch.cat([v for v, _ in video_items]) if video_items else None,
        video_grid_thw=torch.cat([g for _, g in video_items]) if video_items else None,
        video_group=video_group or [-1] * n,
        videos_per_group=[g.shape[0] for _, g in video_items],
        kv_index=torch.cat(kv_parts),
        cu_seqlens_k=torch.tensor(key_lengths, dtype=torch.int32),
    )


def unpack_per_sequence(values: torch.Tensor, mb: PackedMicrobatch) -> list[torch.Tensor]:
    """Split per-target values (K,) back into one tensor per sequence of the micro-batch."""
    counts = torch.bincount(mb.target_seq, minlength=len(mb.sample_indices)).tolist()
    return list(torch.split(values, counts))
