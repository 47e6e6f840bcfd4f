"""The policy: a tiny Llama built locally, HF folders on disk, and a KV-cached forward.

Nothing is ever downloaded. :func:`build_tiny_policy` writes a normal Hugging Face folder
(``config.json``, ``model.safetensors``, ``tokenizer.json``) that ``transformers`` or any
HF-compatible engine loads; :func:`load_policy` opens that folder or any local Llama/Qwen2
checkpoint folder.

:class:`CachedDecoder` is the generation side's forward pass: the same maths as
``LlamaForCausalLM`` (parity is tested against it) over a preallocated KV cache, because
HF's growing cache spends most of a long decode concatenating tensors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from laminar.errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Word-level vocabulary of the built-in tiny model: specials, the numbers 0..255, letters
# and the punctuation the synthetic tasks use. Fixed, so a saved model and a fresh one agree.
TINY_WORDS = (
    *SPECIAL_TOKENS,
    *(str(i) for i in range(256)),
    *"abcdefghijklmnopqrstuvwxyz",
    ">",
    "=",
    "|",
    ":",
    ",",
    "+",
    "-",
    "?",
)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in word-level tokenizer: one token per whitespace-separated symbol.

    >>> tok = build_tokenizer()
    >>> tok.decode(tok("3 1 4 >")["input_ids"])
    '3 1 4 >'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(TINY_WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
    )


def tiny_config(
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 512,
):
    """The HF config of the built-in tiny Llama (what :func:`build_tiny_policy` builds)."""
    from transformers import LlamaConfig

    tok = build_tokenizer()
    return LlamaConfig(
        vocab_size=len(TINY_WORDS),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )


def build_tiny_policy(path: str | Path, *, seed: int = 0, **shape: int) -> Path:
    """Create a freshly initialised tiny Llama and its tokenizer as an HF folder at
    ``path``; ``shape`` takes :func:`tiny_config`'s keywords (``hidden_size``, …)."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(path)
    tok = build_tokenizer()
    cfg = tiny_config(**shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _damaged_model(path: Path, e: Exception) -> ModelError:
    return ModelError(
        f"{str(path)!r} is damaged ({type(e).__name__}: {e}); restore the folder from a "
        "copy (or save_pretrained it again), or point model.path at another HF folder"
    )


def _json_object(path: Path, damaged: Callable[[Path, Exception], Exception]) -> dict:
    """A JSON file that must hold an object; a damaged one is ``damaged(path, error)``,
    and so is one that cannot be read (a folder in its place, no permission: the error
    names it)."""
    try:
        value = json.loads(path.read_text())
        if not isinstance(value, dict):
            raise ValueError(f"a JSON object expected, got {type(value).__name__}")
    except (ValueError, OSError) as e:  # (json.JSONDecodeError and UnicodeDecodeError too)
        raise damaged(path, e) from None
    return value


def check_model_files(folder: Path, damaged: Callable[[Path, Exception], Exception]) -> dict:
    """The folder's model ``config.json``, after reading it, its ``tokenizer_config.json``
    (where there is one) and ``tokenizer.json`` (parsed by ``tokenizers``, as loading it
    does), and the header of each ``*.safetensors`` (the tensors' names, shapes and
    offsets) or the zip directory of ``pytorch_model.bin``; no tensor is loaded, so this
    is cheap enough to run before the cluster starts. A damaged file raises
    ``damaged(path, error)``: the caller says what to do about it."""
    from safetensors import SafetensorError, safe_open
    from tokenizers import Tokenizer

    config = _json_object(folder / "config.json", damaged)
    if (folder / "tokenizer_config.json").exists():
        _json_object(folder / "tokenizer_config.json", damaged)
    path = folder / "tokenizer.json"
    _json_object(path, damaged)
    try:
        Tokenizer.from_str(path.read_text())
    except Exception as e:  # noqa: BLE001 — tokenizers raises a bare Exception ("Model missing")
        raise damaged(path, e) from None
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt") as f:
                if not f.keys():
                    raise ValueError("it holds no tensors")
        except (SafetensorError, OSError, ValueError) as e:
            raise damaged(path, e) from None
    path = folder / "pytorch_model.bin"
    if path.exists() and not any(folder.glob("*.safetensors")):
        check_torch_file(path, damaged)
    return config


WEIGHTS_INDEX = "model.safetensors.index.json"


def weight_files(folder: Path) -> tuple[str, ...]:
    """The files a ``save_pretrained`` folder's weights are in: ``model.safetensors``,
    or, saved sharded (a model past ``max_shard_size``: 5 GB in transformers 4, 50 GB in
    5), ``model.safetensors.index.json`` and each shard its ``weight_map`` names. What a
    folder's manifest must list. An index that cannot be read raises ValueError or
    OSError."""
    index = folder / WEIGHTS_INDEX
    if not index.exists():
        return ("model.safetensors",)
    data = json.loads(index.read_text())
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{str(index)!r} has no weight_map")
    return (WEIGHTS_INDEX, *sorted({str(f) for f in weight_map.values()}))


def check_torch_file(path: Path, damaged) -> None:
    """Raise ``damaged(path, error)`` unless ``path`` is a whole ``torch.save`` file (a
    zip: its directory read, no data)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            if not z.namelist():
                raise ValueError("it holds nothing")
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise damaged(path, e) from None


def check_policy_dir(path: str | Path) -> Path:
    """Raise :class:`ModelError` unless ``path`` is a loadable HF causal-LM folder: its
    files there and undamaged as far as :func:`check_model_files` reads them, of a
    supported architecture, without dropout (:func:`_check_no_dropout`). ``~`` is this
    machine's home (config paths are left as given: each machine reads its own)."""
    path = Path(path).expanduser()
    if path.is_file():
        raise ModelError(
            f"model folder {str(path)!r} is a file; set model.path to the folder that "
            "holds config.json, model.safetensors and tokenizer.json"
        )
    if not path.is_dir():
        raise ModelError(
            f"model folder {str(path)!r} does not exist; set model.path to a local HF "
            "checkpoint folder, or leave it null to build the built-in tiny model"
        )
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).exists()]
    if not any(path.glob("*.safetensors")) and not (path / "pytorch_model.bin").exists():
        missing.append("model.safetensors")
    if missing:
        raise ModelError(
            f"model folder {str(path)!r} lacks {missing}; it must be an HF folder "
            "written by save_pretrained (config.json, model.safetensors, tokenizer.json)"
        )
    config = check_model_files(path, _damaged_model)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"model folder {str(path)!r} has model_type {model_type!r}; the torch engine "
            f"supports {list(SUPPORTED_ARCHITECTURES)}"
        )
    _check_no_dropout(path, config)
    return path


def _is_dropout(key: str) -> bool:
    """An HF config field that is a dropout probability (``attention_dropout``, Llama's
    and Qwen2's; ``hidden_dropout``, ``resid_pdrop``, … of other architectures)."""
    return "dropout" in key or key.endswith("pdrop")


def _check_no_dropout(path: Path, config: dict) -> None:
    """Refuse a policy whose ``config.json`` turns dropout on. The trainer's forwards run
    in training mode (the step's and the proximal one alike), the engines sample without
    dropout: every ratio to the behavior policy, and decoupled PPO's to the proximal one,
    would be noise, not 1, on fresh data. Refused rather than set to 0 here: the folder
    means what it says to every other tool that loads it, and the fix is one edit."""
    on = {
        k: v
        for k, v in config.items()
        if _is_dropout(k) and isinstance(v, int | float) and not isinstance(v, bool) and v > 0
    }
    if on:
        fields = ", ".join(f"{k}={v}" for k, v in sorted(on.items()))
        raise ModelError(
            f"model folder {str(path)!r} turns dropout on ({fields} in its config.json): "
            "the trainer computes logprobs in training mode, so dropout would make its "
            "ratios to the engines' (which sample without it) and to its own proximal "
            "pass differ from 1 on fresh data, as noise in every step. Set "
            f"{' and '.join(sorted(on))} to 0 in {str(path / 'config.json')!r}"
        )


def load_policy(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load an HF causal LM and its tokenizer from a local folder (never a hub)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = check_policy_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model, load_tokenizer(path)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer of a local policy folder; one that does not load (a damaged
    ``tokenizer.json`` or ``tokenizer_config.json``) is a :class:`ModelError` naming it."""
    from transformers import AutoTokenizer

    path = check_policy_dir(path)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 — JSON, tokenizers' bare Exception, OSError, …
        raise ModelError(
            f"cannot load the tokenizer of {str(path)!r} ({type(e).__name__}: {e}); its "
            "tokenizer files (tokenizer.json, tokenizer_config.json) look damaged: restore "
            "the folder from a copy, or point at another model or checkpoint folder"
        ) from e
    if tok.eos_token_id is None:
        _eos_from_config(tok, path)
    return tok


def _eos_from_config(tok, path: Path) -> None:
    """Give a tokenizer without an end-of-sequence token its model's ``eos_token_id``
    (``config.json``), or refuse it: the engines stop a response at the tokenizer's
    ``eos_token_id`` (None: never, every response ran to rollout.max_new_tokens) and the
    warm start ends each demonstration with it (None: a TypeError after the cluster
    started). Every user of the folder loads it here, so all read the same token; the
    warm start's and checkpoints' tokenizers are saved with it."""
    config = _json_object(path / "config.json", _damaged_model)
    eos = config.get("eos_token_id")
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < len(tok):
        tok.eos_token = tok.convert_ids_to_tokens(eos)
        if tok.eos_token_id == eos:
            return
    raise ModelError(
        f"the tokenizer of model folder {str(path)!r} (model.path) has no end-of-sequence "
        f"token, and its config.json's eos_token_id ({eos!r}) cannot stand in (one id of "
        "its vocabulary): responses would never stop, and the warm start could not end "
        'its demonstrations. Set "eos_token" in '
        f"{str(path / 'tokenizer_config.json')!r} to the token that ends a response"
    )


def _rope(cfg) -> dict:
    """The config's RoPE settings: transformers 5's ``rope_parameters``, else 4.x's
    ``rope_scaling`` (``rope_theta`` beside it; None: the default RoPE). A 4.x config
    (transformers>=4.56 is supported) has no ``rope_parameters``: reading only those, a
    scaled RoPE was taken for the default one, and rollouts sampled from other logits."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    return dict(params or {})


def _rope_type(cfg) -> str:
    params = _rope(cfg)  # (4.x's older configs name it "type")
    return params.get("rope_type") or params.get("type") or "default"


def _rope_theta(cfg) -> float:
    theta = _rope(cfg).get("rope_theta", getattr(cfg, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def torch_engine_refusal(cfg) -> tuple[str, bool] | None:
    """Why :class:`CachedDecoder` (the torch engine's forward) cannot generate from a
    model of HF config ``cfg`` — its maths would differ from the trainer's, so it would
    sample from other logits — and whether vLLM's engine can; None when it can."""
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        # (vLLM's Llama and Qwen2 MLPs refuse it too: "Only silu is supported")
        return f"hidden_act {act!r} is not supported by the torch engine (only silu)", False
    kind = _rope_type(cfg)
    if kind != "default":
        return (
            f"rope_type {kind!r} (RoPE scaling) is not supported by the torch engine "
            "(only the default RoPE)",
            True,
        )
    types = getattr(cfg, "layer_types", None)
    if types:
        sliding = any(t != "full_attention" for t in types)
    else:
        sliding = bool(getattr(cfg, "use_sliding_window", False))
    if sliding:
        return (
            "sliding-window attention is not supported by the torch engine; use a config "
            "with use_sliding_window=false",
            True,
        )
    return None


def _check_supported(cfg) -> None:
    """Refuse a config whose forward is not :class:`CachedDecoder`'s maths (SiLU-gated
    MLP, default RoPE, full causal attention): it would generate from other logits than
    the trainer's (:func:`torch_engine_refusal`)."""
    if refusal := torch_engine_refusal(cfg):
        raise ModelError(refusal[0])


def _kv_heads(config) -> tuple[int, int]:
    """An HF config's key-value heads and head dimension (their defaults where it has
    none: as many as its attention heads, ``hidden_size`` over them)."""
    heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or heads
    return n_kv, getattr(config, "head_dim", None) or config.hidden_size // heads


def cache_bytes(config, rows: int, columns: int) -> int:
    """The bytes of the cache :meth:`CachedDecoder.new_cache` makes for ``config`` (the
    torch engine's KV cache, allocated whole: ``rows`` requests of ``columns`` tokens)."""
    n_kv, head_dim = _kv_heads(config)
    values = config.num_hidden_layers * 2 * rows * n_kv * columns * head_dim
    return values * torch.empty((), dtype=torch.get_default_dtype()).element_size()


class CachedDecoder:
    """Llama/Qwen2 forward over a preallocated, slotted KV cache (inference only).

    The cache is ``[layers, 2, rows, kv_heads, columns, head_dim]``: one row per running
    sequence, column ``c`` holding the keys/values of the sequence's token ``c`` (RoPE
    position ``c``; there is no padding inside a row). Two entry points, both on a view of
    the first rows of the cache:

    * :meth:`prefill` — right-padded sequences written from column 0 (new or resumed
      requests); returns the logits after each sequence's last real token;
    * :meth:`decode` — one token per row, each written at its own column (rows have
      different lengths: continuous batching).
    """

    def __init__(self, config, state: dict[str, torch.Tensor], device: str = "cpu") -> None:
        _check_supported(config)
        self.config = config
        self.device = torch.device(device)
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv, self.head_dim = _kv_heads(config)
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps
        dim = self.head_dim
        inv_freq = 1.0 / (_rope_theta(config) ** (torch.arange(0, dim, 2).float() / dim))
        self.inv_freq = inv_freq.to(self.device)
        self._rope_len = 0
        self.load(state)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Take weights from an HF state dict (``model.layers.N...`` names): all of them
        or, if one is missing, none (the decoder keeps the weights it had)."""

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            t = state.get(name)
            if t is None and required:
                raise ModelError(f"weights lack {name!r}: not a Llama/Qwen2 state dict")
            # A copy, always: for fp32 weights on the CPU, .to() alone returns the same
            # tensor, and the engine would compute with the relay puller's receive buffer,
            # which the next pull overwrites chunk by chunk (a pull that fails partway
            # left a torn mix of two versions, labelled as the older).
            return None if t is None else t.detach().to(self.device, torch.float32, copy=True)

        embed = get("model.embed_tokens.weight")
        final_norm = get("model.norm.weight")
        lm_head = get("lm_head.weight", required=False)
        layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            layers.append(
                {
                    "ln1": get(p + "input_layernorm.weight"),
                    "ln2": get(p + "post_attention_layernorm.weight"),
                    **{k: get(p + f"self_attn.{k}_proj.weight") for k in ("q", "k", "v", "o")},
                    # Qwen2 has q/k/v biases; a Llama with attention_bias has o's too,
                    # and with mlp_bias gate/up/down's.
                    **{
                        f"{k}_b": get(p + f"self_attn.{k}_proj.bias", required=False)
                        for k in ("q", "k", "v", "o")
                    },
                    **{k: get(p + f"mlp.{k}_proj.weight") for k in ("gate", "up", "down")},
                    **{
                        f"{k}_b": get(p + f"mlp.{k}_proj.bias", required=False)
                        for k in ("gate", "up", "down")
                    },
                }
            )
        # (assigned only once every weight was found: an engine whose load failed keeps
        # decoding with its old weights, not a mix of both)
        self.embed, self.final_norm, self.layers = embed, final_norm, layers
        self.lm_head = embed if lm_head is None else lm_head

    def new_cache(self, rows: int, columns: int) -> torch.Tensor:
        """A zeroed cache ``[layers, 2, rows, kv_heads, columns, head_dim]``."""
        return torch.zeros(
            self.n_layers, 2, rows, self.n_kv, columns, self.head_dim, device=self.device
        )

    @torch.inference_mode()
    def prefill(
        self, tokens: torch.Tensor, lengths: torch.Tensor, cache: torch.Tensor
    ) -> torch.Tensor:
        """Write right-padded ``tokens`` ``[B, T]`` to columns ``0..T`` of ``cache``'s rows.

        ``lengths`` ``[B]`` counts each row's real tokens; columns past it receive garbage
        that later decode steps overwrite and never attend to. Returns ``[B, vocab]``: the
        logits after each row's last real token.
        """
        bsz, t = tokens.shape
        cols = torch.arange(t, device=self.device)
        positions = cols[None].expand(bsz, t)
        # Causal, and pad keys hidden; a pad query still sees itself, so no row is empty.
        allowed = (cols[None, :] <= cols[:, None])[None] & (cols < lengths[:, None])[:, None, :]
        allowed |= torch.eye(t, dtype=torch.bool, device=self.device)[None]

        def write(i: int, k: torch.Tensor, v: torch.Tensor):
            cache[i, 0, :, :, :t] = k
            cache[i, 1, :, :, :t] = v
            return cache[i, 0, :, :, :t], cache[i, 1, :, :, :t]

        x = self._layers(tokens, positions, allowed[:, None], write)
        last = x[torch.arange(bsz, device=self.device), lengths - 1]
        return F.linear(self._norm(last, self.final_norm), self.lm_head)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, columns: torch.Tensor, cache: torch.Tensor):
        """Write one token per row, ``tokens[i]`` at column ``columns[i]`` of row ``i``.

        Row ``i`` attends to its columns ``0..columns[i]``. Returns ``[B, vocab]`` logits.
        """
        bsz = tokens.shape[0]
        end = int(columns.max()) + 1
        rows = torch.arange(bsz, device=self.device)
        hidden = torch.arange(end, device=self.device)[None, :] > columns[:, None]
        bias = torch.zeros(bsz, 1, 1, end, device=self.device).masked_fill_(
            hidden[:, None, None], float("-inf")
        )

        def write(i: int, k: torch.Tensor, v: torch.Tensor):
            cache[i, 0, rows, :, columns] = k[:, :, 0]
            cache[i, 1, rows, :, columns] = v[:, :, 0]
            return cache[i, 0, :, :, :end], cache[i, 1, :, :, :end]

        x = self._layers(tokens[:, None], columns[:, None], bias, write, single=True)
        return F.linear(self._norm(x[:, -1], self.final_norm), self.lm_head)

    def _layers(self, tokens, positions, mask, write, single: bool = False) -> torch.Tensor:
        """The decoder layers. ``single``: one query per row, and ``mask`` is an additive
        bias ``[B, 1, 1, S]``; plain matmuls then beat SDPA's masked path on CPU ≈ 2×
        (the cache views are strided), and grouped-query heads need no key copies."""
        bsz, t = tokens.shape
        x = self.embed[tokens]
        cos, sin = self._rope(positions)
        rep = self.n_heads // self.n_kv
        for i, w in enumerate(self.layers):
            h = self._norm(x, w["ln1"])
            q = F.linear(h, w["q"], w["q_b"]).view(bsz, t, self.n_heads, self.head_dim)
            k = F.linear(h, w["k"], w["k_b"]).view(bsz, t, self.n_kv, self.head_dim)
            v = F.linear(h, w["v"], w["v_b"]).view(bsz, t, self.n_kv, self.head_dim)
            q = self._rotate(q.transpose(1, 2), cos, sin)
            k = self._rotate(k.transpose(1, 2), cos, sin)
            keys, values = write(i, k, v.transpose(1, 2))
            if single:
                # Query heads j*rep..j*rep+rep-1 share key/value head j.
                qg = q.reshape(bsz, self.n_kv, rep, self.head_dim)
                scores = qg @ keys.transpose(-1, -2) * self.head_dim**-0.5 + mask
                att = (torch.softmax(scores, dim=-1) @ values).reshape(bsz, self.n_heads, 1, -1)
            else:
                if rep > 1:
                    keys = keys.repeat_interleave(rep, dim=1)
                    values = values.repeat_interleave(rep, dim=1)
                att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            x = x + F.linear(att.transpose(1, 2).reshape(bsz, t, -1), w["o"], w["o_b"])
            h = self._norm(x, w["ln2"])
            gate = F.silu(F.linear(h, w["gate"], w["gate_b"]))
            x = x + F.linear(gate * F.linear(h, w["up"], w["up_b"]), w["down"], w["down_b"])
        return x

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, 1, T, D]`` at ``positions``, from a table grown on demand."""
        need = int(positions.max()) + 1
        if need > self._rope_len:
            n = max(need, 2 * self._rope_len, 256)
            freqs = torch.arange(n, device=self.device).float()[:, None] * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
            self._cos, self._sin, self._rope_len = emb.cos(), emb.sin(), n
        return self._cos[positions][:, None], self._sin[positions][:, None]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def param_count(state: dict[str, torch.Tensor]) -> int:
    """Number of parameters in a state dict."""
    return sum(math.prod(t.shape) for t in state.values())


def encode_prompt(tok, text: str) -> list[int]:
    """``<bos>`` + the tokens of ``text`` (no other special tokens)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + list(ids)
