"""The bytes a hybrid target's recurrent layers move per round, beside the KV and weight bytes.

A slot's state (every linear layer's conv inputs and fp32 delta state, S bytes) is not paged
KV: a round moves it once per sequence, whatever the context. With J the compact journal's
bytes per row (`RecurrentStates.journal_bytes_per_row`):
    AR row or prefill chunk:    S read + S written                          = 2 S
    SPEC group of d rows:       S read, d J written (verify); at commit, S read and written
                                and the journal of the a + 1 kept rows read  = 3 S + (d + a + 1) J
The profile's measured rounds already pay these bytes; the section written here says how big
they are, so that a roofline of a hybrid round counts them and a reader of the profile sees why
sequences cost more than the weights and KV explain: at the 27B shape S is 154 MB, so an AR
round of 64 sequences moves 19.7 GB of state beside the weights' 53.8 GB.
"""

from __future__ import annotations

from executor.model_config import ModelConfig
from executor.recurrent_state import RecurrentStates


def recurrent_section(cfg: ModelConfig, dtype_bytes: int) -> dict:
    """The profile's `target.recurrent` section of a hybrid target."""
    return {
        "num_linear_layers": len(cfg.linear_layer_ids),
        "num_kv_layers": len(cfg.kv_layer_ids),
        "state_bytes_per_seq": RecurrentStates.bytes_per_slot(cfg, dtype_bytes),
        "journal_bytes_per_row": RecurrentStates.journal_bytes_per_row(cfg, dtype_bytes),
        "note": (
            "per round: AR sequence 2 x state; SPEC group of d rows with a accepted "
            "3 x state + (d + a + 1) x journal"
        ),
    }


def recurrent_round_bytes(
    section: dict | None,
    num_ar_seqs: int,
    num_spec_rows: list[int] | tuple[int, ...] = (),
    num_accepted: list[int] | tuple[int, ...] | None = None,
) -> int:
    """Bytes the recurrent layers move in one round of `num_ar_seqs` AR sequences (or prefill
    chunks) and SPEC groups of `num_spec_rows` rows each, of which `num_accepted` drafts are
    kept (None: all, the most a commit reads); 0 for a target without the section."""
    if not section:
        return 0
    state, journal = section["state_bytes_per_seq"], section["journal_bytes_per_row"]
    accepted = [d - 1 for d in num_spec_rows] if num_accepted is None else num_accepted
    spec = sum(3 * state + (d + a + 1) * journal for d, a in zip(num_spec_rows, accepted))
    return 2 * state * num_ar_seqs + spec
