"""Where a layer's KV blocks live inside its tensor: the layouts vLLM's attention backends hand a connector.

Pure arithmetic on shape, strides and element size (no torch import), unit-tested directly. One block of
one layer is ``segments`` byte ranges of ``segment_bytes`` each; segment ``s`` of block ``b`` starts
``s * segment_stride + b * block_stride`` bytes after the tensor's data pointer. Both sides must lay a
layer out the same way (the compatibility hash carries ``desc``); kvlink then moves each segment as
opaque bytes, so the order of heads, tokens and channels inside it does not matter.

- vLLM CPU: ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (each head's K rows, then its V rows):
  one segment per block.
- FlashAttention: ``[2, num_blocks, block_size, kv_heads, head_size]`` (NHD), or the HND cache vLLM
  allocates heads-first and hands over as a permuted view of that shape: two segments, the K plane and
  the V plane.
- FlashInfer: ``[num_blocks, 2, block_size, kv_heads, head_size]`` (NHD, or HND as a permuted view): one
  segment (K and V of a block are adjacent).
- MLA: ``[num_blocks, block_size, latent]`` (GPU backends) or ``[num_blocks, 1, block_size, latent]``
  (CPU): one segment.

Anything else (a block whose elements are not one dense range, negative or overlapping strides, another
rank) is refused with the shape and strides named.

KV heads (tensor parallelism shards them): a rank's block holds ``heads`` heads. Where heads are outermost
in a block (vLLM CPU, HND; FlashInfer's K and V each), the heads ``[a, b)`` of a segment are one byte
range, ``head_bytes`` each, in each of ``parts`` parts (FlashInfer's K and V halves of a segment), so
another TP size can read a head range as descriptors (shard.py). NHD interleaves heads per token: only
whole blocks move (``head_bytes`` is 0). ``desc`` names the head dimension ``h`` instead of its size, so
ranks holding different head counts of one model compare equal; the compatibility check compares the
model's total KV heads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from math import prod


class LayoutError(ValueError):
    """A KV cache tensor kvlink cannot move block by block; the message names shape and strides."""


@dataclass(frozen=True)
class BlockLayout:
    num_blocks: int
    segments: int  # byte ranges per block: 2 for separate K and V planes, else 1
    segment_stride: int  # bytes from one plane to the next (0 with one segment)
    block_stride: int  # bytes from block b to block b + 1 within a plane
    segment_bytes: int  # bytes of one block in one plane
    span: int  # bytes from the data pointer that hold every block of the layer
    desc: str  # what the compatibility hash compares between prefill and decode
    heads: int = 0  # KV heads in a block of this rank (0: MLA's latent, which every rank holds whole)
    head_bytes: int = 0  # bytes of one head in one part, where heads are outermost (0: heads cannot be cut)
    parts: int = 1  # head-major runs per segment: 2 where K and V share a segment (FlashInfer), else 1
    part_stride: int = 0  # bytes from one part to the next within a segment

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this layer, all segments."""
        return self.segments * self.segment_bytes

    @property
    def runs_coalesce(self) -> bool:
        """Consecutive blocks are adjacent in each plane, so a run of them is one byte range."""
        return self.block_stride == self.segment_bytes

    def geometry(self, offset: int = 0) -> "Geometry":
        """Where this layer's blocks sit when its tensor starts ``offset`` bytes into a region."""
        return Geometry(offset, self.block_stride, self.segment_stride)


@dataclass(frozen=True)
class Geometry:
    """Where one layer's blocks sit in a transport region: segment ``s`` of block ``b`` starts at
    ``offset + s * segment_stride + b * block_stride``. Prefill's and decode's geometries of a layer may
    differ (another ``num_blocks`` moves a V plane; a staging pool packs the layers of a block together);
    the bytes of a segment may not (the compatibility hash compares ``BlockLayout.desc``)."""

    offset: int
    block_stride: int
    segment_stride: int


def pool_geometry(layout: BlockLayout, layer: int, rows: int) -> Geometry:
    """Layer ``layer`` in a staging pool of ``rows`` slots per layer, layer-major (stager.py): slot ``b`` of
    a layer holds block ``b`` of that layer, segments in order, and a run of slots is one byte range."""
    return Geometry(layer * rows * layout.block_bytes, layout.block_bytes, layout.segment_bytes)


def head_geometry(g: Geometry, layout: BlockLayout, first: int, heads: int) -> Geometry:
    """Heads ``[first, ...)`` of each segment (and each part) of blocks at ``g``, on a side whose rank holds
    ``heads`` heads: a LayerMap of ``segments * parts`` ranges of ``count * head_bytes`` each. Needs heads
    outermost (``layout.head_bytes`` > 0); K and V parts of a segment are ``heads * head_bytes`` apart."""
    if not layout.head_bytes:
        raise LayoutError(f"KV layout {layout.desc}: heads are not outermost in a block (NHD), so a head range "
                          "is not one byte range")
    stride = heads * layout.head_bytes if layout.parts > 1 else g.segment_stride
    return Geometry(g.offset + first * layout.head_bytes, g.block_stride, stride)


def state_layout(parts: list[tuple[int, tuple[int, ...], tuple[int, ...], int, str]]) -> BlockLayout:
    """A layer whose block is a per-request state (Mamba: conv state, then SSM state, packed in one page of a
    buffer vLLM shares with the other groups): ``parts`` are the state tensors as (data pointer, shape,
    strides in elements, element size, dtype name), each ``[num_blocks, ...]``. One segment per block, from
    the first tensor's pointer to the end of the last state byte; moved whole (never cut by heads). The
    description names each part's offset in the page, dtype, shape and strides: two engines whose states
    fill a page of the same size otherwise (a conv state stored transposed, ``VLLM_SSM_CONV_STATE_LAYOUT``;
    an SSM state in float16 against bfloat16, ``--mamba-ssm-cache-dtype``) must not pair."""
    base, shape0, strides0, size0, _ = parts[0]
    page, num_blocks = strides0[0] * size0, shape0[0]
    what = f"state tensors {[(list(sh), list(st)) for _, sh, st, _, _ in parts]}"
    end = 0
    kinds = []
    for ptr, shape, strides, size, dtype in parts:
        row = (sum((n - 1) * st for n, st in zip(shape[1:], strides[1:])) + 1) * size
        if shape[0] != num_blocks or strides[0] * size != page or ptr < base or ptr - base + row > page:
            raise LayoutError(f"{what}: the state tensors of a block do not share one page of {page} bytes")
        end = max(end, ptr - base + row)
        kinds.append(f"{ptr - base}:{dtype}:{'x'.join(map(str, shape[1:]))}:{'.'.join(map(str, strides[1:]))}")
    parts_desc = ",".join(kinds)
    if len(parts_desc) > 160:  # (a registration's values are short; the digest tells them apart as well)
        parts_desc = "sha256:" + hashlib.sha256(parts_desc.encode()).hexdigest()[:24]
    return BlockLayout(num_blocks=num_blocks, segments=1, segment_stride=0, block_stride=page, segment_bytes=end,
                       span=(num_blocks - 1) * page + end, desc=f"state:{end}:{parts_desc}")


def block_layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, mla: bool = False) -> BlockLayout:
    """The block layout of one layer's KV tensor (``strides`` in elements, as torch gives them). ``mla``: the
    tensor is MLA's latent cache (no heads; vLLM CPU's 4-D MLA shape is otherwise its attention shape)."""
    shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)
    what = f"KV cache tensor of shape {list(shape)} and strides {list(strides)}"
    if not 3 <= len(shape) <= 5 or len(strides) != len(shape):
        raise LayoutError(f"{what}: kvlink moves 3- to 5-dimensional caches with the blocks in dimension 0 "
                          "(vLLM CPU, FlashInfer, MLA) or 1 after a K/V dimension of 2 (FlashAttention)")
    if any(s < 0 for s in strides) or any(n <= 0 for n in shape):
        raise LayoutError(f"{what}: negative strides or empty dimensions")
    planes = len(shape) == 5 and shape[0] == 2  # FlashAttention: [2, num_blocks, ...]
    bdim = 1 if planes else 0
    inner = list(zip(shape[bdim + 1:], strides[bdim + 1:]))
    if not _dense(inner):
        raise LayoutError(f"{what}: one block's elements are not one contiguous range, so a block cannot be "
                          "moved as bytes")
    seg_elems = prod(shape[bdim + 1:])
    num_blocks, block_stride = shape[bdim], strides[bdim]
    if num_blocks > 1 and block_stride < seg_elems:
        raise LayoutError(f"{what}: blocks overlap (block stride {block_stride} < {seg_elems} elements)")
    segment_stride = strides[0] if planes else 0
    after = segment_stride >= (num_blocks - 1) * block_stride + seg_elems  # V plane after all of K
    interleaved = seg_elems <= segment_stride and segment_stride + seg_elems <= block_stride  # K, V per block
    if planes and not (after or interleaved):
        raise LayoutError(f"{what}: the K and V planes overlap")
    span = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * itemsize
    kind = "kv-planes" if planes else "blocks"
    # Which inner dimension holds the heads: FlashAttention/FlashInfer [.., block_size, heads, head_size],
    # vLLM CPU [num_blocks, heads, block_size, 2 * head_size]; MLA has none.
    hdim = None if mla or len(shape) == 3 else (3 if len(shape) == 5 else 1)
    kvdim = 1 if len(shape) == 5 and not planes else None  # FlashInfer's K/V dimension inside a block
    sizes = ["h" if d == hdim else str(shape[d]) for d in range(bdim + 1, len(shape))]
    order = sorted(range(bdim + 1, len(shape)), key=lambda d: (-strides[d], d))  # outermost first
    desc = f"{kind}:{'x'.join(sizes)}:{'.'.join(str(d) for d in order)}:{itemsize}"
    heads = head_bytes = part_stride = 0
    parts = 1
    if hdim is not None:
        heads = shape[hdim]
        rest = [d for d in order if d != kvdim]
        if kvdim is not None and order[0] == kvdim:
            parts, part_stride = 2, strides[kvdim] * itemsize
        if rest[0] == hdim and (kvdim is None or order[0] == kvdim):
            head_bytes = strides[hdim] * itemsize if heads > 1 else seg_elems * itemsize // parts
    return BlockLayout(num_blocks=num_blocks, segments=2 if planes else 1, segment_stride=segment_stride * itemsize,
                       block_stride=block_stride * itemsize, segment_bytes=seg_elems * itemsize, span=span,
                       desc=desc, heads=heads, head_bytes=head_bytes, parts=parts, part_stride=part_stride)


def _dense(dims: list[tuple[int, int]]) -> bool:
    """The dimensions (size, stride) cover one contiguous range in some order (a permutation of a dense
    layout), as a block of NHD or HND does."""
    expected = 1
    for size, stride in sorted((d for d in dims if d[0] > 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def tokens_per_block(shape: tuple[int, ...]) -> int:
    """Tokens in one block, read from a shape of the layouts above (dimension 2, or 1 for 3-D MLA)."""
    return int(shape[1] if len(shape) == 3 else shape[2])

