"""DeepEP V2's combine: the rows' trip home, and the reduction recipe that sums them.

ubep.Buffer.combine returns each token's sum, in an order of its own; DeepEP V2
fixes the order and the roundings, so the home rank needs every rank's row
unsummed. Here the trip home is itself a ubep dispatch, through a second
ubep.Buffer whose experts are (home rank, lane) pairs: expert s * K + k is lane k
of rank s. A row sent home under the lanes it answers for arrives with those
lanes as local expert ids, and their weights as its received top-k weights.

    owner: the rows to send       stream 0: one per received token (non-expand input, or the
                                  token's expanded rows summed over this rank's lanes)
                                  streams j < J (expand without multiple reduction): the row of
                                  each token's j-th lane here
    trip:  ubep dispatch          chunks of T rows (T = num_max_tokens_per_rank, the second
                                  Buffer's capacity); positions agree through `sent_SRJ`
    home:  y [N, K, H]            each row at the last lane it answers for, zeros elsewhere
           recipe                 hybrid: round per scale-out domain (its lanes summed in order);
                                  then bias + y[:, 0] + ... + y[:, K - 1] in float32, one rounding

Legend: see `elastic_handle`; P rows of one stream.
Example, K = 3, token lanes on ranks [1, 0, 1]: rank 1's row lands in lane 2, rank 0's in
lane 1, so combined = round(bias + 0 + row_0 + row_1): ranks in the order of their last lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ubep.buffer import Buffer as UbepBuffer
from ubep.compat.deep_ep.elastic_handle import ElasticRoute


@dataclass(frozen=True, slots=True)
class Stream:
    """Rows one owner sends home in one stream, in its received-row order."""

    rows_PH: torch.Tensor
    lanes_PK: torch.Tensor  # bool: the lanes each row answers for
    weights_PK: torch.Tensor  # float32: those lanes' weights (zeros elsewhere)
    home_P: torch.Tensor  # int64: each row's home rank


def local_sum(x_XH: torch.Tensor, slot_MK: torch.Tensor) -> torch.Tensor:
    """[M, H]: each token's expanded rows summed in lane order (float32), rounded once to x's dtype."""
    acc_MH = torch.zeros(slot_MK.shape[0], x_XH.shape[1], dtype=torch.float32, device=x_XH.device)
    for k in range(slot_MK.shape[1]):
        here = slot_MK[:, k] >= 0
        acc_MH[here] += x_XH[slot_MK[here, k]].float()
    return acc_MH.to(x_XH.dtype)


def owner_streams(x, weights, route: ElasticRoute, do_expand: bool, multiple: bool) -> list[Stream]:
    """What this rank sends home: one stream of rows per token, or one per lane when nothing may
    be reduced before the home rank (expand mode without multiple reduction)."""
    M = route.num_recv
    local_MK = route.recv_topk_idx_MK >= 0
    home_M = route.inner.recv_src_rank_M
    slot_MK = route.slot_MK
    if not do_expand:
        w_MK = weights[:M] if weights is not None else _zero_weights(local_MK)
        return [Stream(x[:M], local_MK, torch.where(local_MK, w_MK, 0.0), home_M)]
    if multiple:
        w_MK = weights[slot_MK.clamp_min(0)] if weights is not None else _zero_weights(local_MK)
        return [Stream(local_sum(x, slot_MK), local_MK, torch.where(local_MK, w_MK, 0.0), home_M)]
    ordinal_MK = local_MK.long().cumsum(dim=1) - 1  # which of its row's local lanes each lane is
    streams = []
    for j in range(route.num_streams):
        rows_P = route.stream_rows(j)
        lane_PK = local_MK[rows_P] & (ordinal_MK[rows_P] == j)
        slot_P = slot_MK[rows_P].gather(1, lane_PK.long().argmax(dim=1, keepdim=True)).flatten()
        streams.append(Stream(x[slot_P], lane_PK, _zero_weights(lane_PK), home_M[rows_P]))
    return streams


def _zero_weights(lanes_XK: torch.Tensor) -> torch.Tensor:
    """float32 zeros of the lanes' shape, on their device: weights are float32 whatever the default."""
    return torch.zeros(lanes_XK.shape, dtype=torch.float32, device=lanes_XK.device)


@dataclass(frozen=True, slots=True)
class Arrived:
    """Rows that reached their home: each one's token, the lanes it answers for, their weights."""

    token_A: torch.Tensor
    lane_idx_AK: torch.Tensor  # lane k where the row answers for lane k, -1 elsewhere
    weights_AK: torch.Tensor
    rows_AH: torch.Tensor


def send_home(trip: UbepBuffer, stream: Stream, table_RP: torch.Tensor, chunk: int, chunks: int) -> Arrived:
    """Move one stream home in `chunks` ubep dispatches of at most `chunk` rows per rank (collective)."""
    K = stream.lanes_PK.shape[1]
    lane_K = torch.arange(K, dtype=torch.int64, device=stream.home_P.device)
    got_parts = []
    for c in range(chunks):
        part = slice(c * chunk, (c + 1) * chunk)
        idx_PK = torch.where(stream.lanes_PK[part], stream.home_P[part, None] * K + lane_K, -1)
        got = trip.dispatch(stream.rows_PH[part], topk_idx=idx_PK, topk_weights=stream.weights_PK[part])
        position_A = c * chunk + got.handle.recv_src_token_M
        token_A = table_RP[got.handle.recv_src_rank_M, position_A]
        if bool((token_A < 0).any()):
            raise RuntimeError("combine: a row came home to a position its dispatch did not fill")
        got_parts.append((token_A, got.recv_topk_idx, got.recv_topk_weights, got.recv_x))
    if not got_parts:
        device = stream.home_P.device
        return Arrived(
            torch.zeros(0, dtype=torch.int64, device=device),
            torch.zeros(0, K, dtype=torch.int64, device=device),
            torch.zeros(0, K, dtype=torch.float32, device=device),
            stream.rows_PH[:0],
        )
    return Arrived(*(torch.cat(parts) for parts in zip(*got_parts, strict=True)))


def place(arrived: list[Arrived], num_tokens: int, num_topk: int, like: torch.Tensor):
    """(y [N, K, H], weights [N, K]): each row at the last lane it answers for, weights at every lane."""
    y_NKH = torch.zeros(num_tokens, num_topk, like.shape[1], dtype=like.dtype, device=like.device)
    w_NK = torch.zeros(num_tokens, num_topk, dtype=torch.float32, device=like.device)
    for a in arrived:
        valid_AK = a.lane_idx_AK >= 0
        last_A = torch.where(valid_AK, a.lane_idx_AK, -1).amax(dim=1) if a.token_A.numel() else a.token_A
        y_NKH[a.token_A, last_A] = a.rows_AH
        token_AK = a.token_A.unsqueeze(1).expand_as(valid_AK)
        w_NK[token_AK[valid_AK], a.lane_idx_AK[valid_AK]] = a.weights_AK[valid_AK]
    return y_NKH, w_NK


def round_groups(y_NKH: torch.Tensor, group_NK: torch.Tensor) -> torch.Tensor:
    """Each group's lanes summed in lane order (float32), rounded once, left at the group's last lane.

    Example, groups [0, 1, 0]: lane 2 gets round(y0 + y2), lane 1 round(y1), lane 0 zero.
    """
    N, K, H = y_NKH.shape
    g_NK = group_NK - group_NK.min() if group_NK.numel() else group_NK
    acc_NGH = torch.zeros(
        N, int(g_NK.max()) + 1 if g_NK.numel() else 1, H, dtype=torch.float32, device=y_NKH.device
    )
    out_NKH = torch.zeros_like(y_NKH)
    rows_N = torch.arange(N, dtype=torch.int64, device=y_NKH.device)
    for k in range(K):
        acc_NGH[rows_N, g_NK[:, k]] += y_NKH[:, k].float()
        last_N = ~(g_NK[:, k + 1 :] == g_NK[:, k : k + 1]).any(dim=1)
        out_NKH[last_N, k] = acc_NGH[rows_N[last_N], g_NK[last_N, k]].to(y_NKH.dtype)
    return out_NKH


def reduce_home(y_NKH, topk_idx_NK, domain_experts: int | None, biases: list[torch.Tensor]) -> torch.Tensor:
    """DeepEP V2's home reduction: optional per-domain rounding, then bias first and lanes in order."""
    if domain_experts is not None:
        y_NKH = round_groups(y_NKH, torch.where(topk_idx_NK >= 0, topk_idx_NK // domain_experts, -1))
    N, K, H = y_NKH.shape
    acc_NH = torch.zeros(N, H, dtype=torch.float32, device=y_NKH.device)
    if biases:
        acc_NH = biases[0].float() + biases[1].float() if len(biases) == 2 else biases[0].float()
    for k in range(K):
        acc_NH = acc_NH + y_NKH[:, k].float()
    return acc_NH.to(y_NKH.dtype)
