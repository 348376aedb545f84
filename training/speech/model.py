"""SALM: a speech encoder and a modality adapter feeding a transformers causal LM.

``SALM.forward(audio, audio_lens, input_ids, labels, audio_mask, position_ids)`` -> summed answer
cross-entropy (+ the weighted CTC loss in training, step 5):

1. log-mel features on the device (``headrace.kernels.log_mel``: the loader's DALI features to < 1e-3 dB for a
   parakeet encoder, ``WhisperFeatureExtractor``'s over a fixed window for a whisper one), SpecAugment in
   training when configured;
2. the encoder (transformers' ``ParakeetEncoder``: FastConformer, 2^k conv subsampling, or
   ``WhisperEncoder``; ``headrace.training.speech.encoders``) -> frames;
3. the adapter stacks ``subsampling`` consecutive frames and projects them to the LLM's width;
4. ``SpeechLMLoss`` embeds the prompt tokens, writes the valid adapter frames into the positions
   ``audio_mask`` marks (the expanded audio placeholder, see ``headrace.training.speech.prompt``), runs the
   decoder and the chunked cross-entropy on the answer labels;
5. in training with ``model.speech.ctc_weight > 0``, plus that weight times the CTC loss of each transcript
   over its encoder frames (a linear head to the vocabulary + blank on the encoder's output; joint
   CTC/attention): a signal that ties the encoder to the audio while the LLM learns the text prior.

Step 4 runs inside the LLM wrapper's forward so that under FSDP2 its root unit has the embedding and
the lm_head unsharded (the same reason as ``headrace.training.models.loss.CausalLMLoss``). Under TP+SP the embedding
output is replicated, the frames are written, and the sequence is then split over the tp ranks with a
DTensor redistribute (its backward all-gathers the gradient, so embedding and encoder see all of it).

Module names: ``encoder.*`` (transformers'), ``adapter.*``, ``llm.model.*`` / ``llm.lm_head.*``
(transformers' names under ``llm.``), so the export splits the state dict by prefix.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import PretrainedConfig

from headrace.kernels.log_mel import spec_augment
from headrace.kernels.loss import IGNORE_INDEX
from headrace.training.config.speech import SpeechConfig
from headrace.training.errors import refused_as
from headrace.training.models.build import build_meta_model, load_safetensors, materialize
from headrace.training.models.loss import CausalLMLoss
from headrace.training.speech.bridge import CTCBridge, token_embeddings
from headrace.training.speech.checkpoints import part_prefix, salm_name
from headrace.training.speech.encoders import front_end, masked_frames


class Adapter(nn.Module):
    """Stack ``k`` consecutive encoder frames (temporal subsampling by ``k``), then Linear-GELU-Linear."""

    def __init__(
        self, in_size: int, out_size: int, subsampling: int, hidden_size: int | None = None, bias: bool = True
    ):
        super().__init__()
        self.subsampling = subsampling
        hidden_size = hidden_size or out_size
        self.proj_in = nn.Linear(in_size * subsampling, hidden_size, bias=bias)
        self.act = nn.GELU()
        self.proj_out = nn.Linear(hidden_size, out_size, bias=bias)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        return -torch.div(-lengths, self.subsampling, rounding_mode="floor")  # ceil

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        batch, time, size = frames.shape
        pad = (-time) % self.subsampling
        frames = nn.functional.pad(frames, (0, 0, 0, pad))
        stacked = frames.reshape(batch, (time + pad) // self.subsampling, size * self.subsampling)
        return self.proj_out(self.act(self.proj_in(stacked)))

    def reset_parameters(self) -> None:
        self.proj_in.reset_parameters()
        self.proj_out.reset_parameters()


class LinearAdapter(nn.Module):
    """One Linear from encoder frames to LLM embeddings, no stacking (Qwen2-Audio's ``multi_modal_projector``)."""

    def __init__(self, in_size: int, out_size: int):
        super().__init__()
        self.linear = nn.Linear(in_size, out_size)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.linear(frames)

    def reset_parameters(self) -> None:
        self.linear.reset_parameters()


def build_adapter(cfg, in_size: int, out_size: int, vocab_size: int) -> nn.Module:
    """The adapter of ``model.speech.adapter.kind`` (``ctc_bridge``: ``headrace.training.speech.bridge``, its CTC
    head over the LLM's ``vocab_size`` tokens + blank)."""
    if cfg.kind == "linear":
        return LinearAdapter(in_size, out_size)
    mlp = Adapter(in_size, out_size, cfg.subsampling, cfg.hidden_size, cfg.bias)
    if cfg.kind == "ctc_bridge":
        return CTCBridge(mlp, nn.Linear(in_size, vocab_size + 1))
    return mlp


class SpeechLMLoss(CausalLMLoss):
    """``CausalLMLoss`` whose inputs are prompt tokens plus audio frames written at ``audio_mask``."""

    sequence_mesh: DeviceMesh | None = None  # the tp mesh under sequence parallelism (set by parallelize)
    token_mass: bool = False  # the audio frames carry a ``CTCBridge``'s token mass (set by build_meta_salm)

    def embed(self, input_ids: torch.Tensor, audio_embeds: torch.Tensor, audio_mask: torch.Tensor) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        if self.token_mass:
            audio_embeds = token_embeddings(audio_embeds, self.model.embed_tokens.weight)
        return embeds.masked_scatter(audio_mask[..., None], audio_embeds.to(embeds.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None,
        *,
        audio_embeds: torch.Tensor,
        audio_mask: torch.Tensor,
        position_ids: torch.Tensor,
        **kwargs,
    ) -> torch.Tensor:
        embeds = self.embed(input_ids, audio_embeds, audio_mask)
        if self.sequence_mesh is not None:  # SP: this rank's sequence slice; backward all-gathers the grad
            embeds = DTensor.from_local(embeds, self.sequence_mesh, [Replicate()], run_check=False)
            embeds = embeds.redistribute(self.sequence_mesh, [Shard(1)]).to_local()
        return super().forward(None, labels, inputs_embeds=embeds, position_ids=position_ids, **kwargs)


def encoder_frames(
    model: nn.Module, audio: torch.Tensor, audio_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frames ``[B, T, H]`` of ``model.encoder`` (a SALM's, or the CTC stage's: ``headrace.training.speech.ctc``)
    on its front end's features, SpecAugmented in training, zero past each utterance's audio; and each
    utterance's frame count. ``model`` has ``front``, ``encoder``, ``cfg`` (a ``SpeechConfig``), ``augment_generator``."""
    feats, frames = model.front.features(model.encoder, audio, audio_lens)
    if model.training and model.cfg.spec_augment.enabled:
        feats = spec_augment(feats, frames, model.cfg.spec_augment, model.augment_generator)
    hidden = model.front.hidden(model.encoder, feats, frames)
    covered = model.front.output_frames(model.encoder, audio_lens).to(hidden.device)
    # Frames past each utterance's audio are zeroed before the adapter stacks them, so its last slot does
    # not depend on what else is in the batch; past the longest one (Whisper's window) they are skipped.
    hidden = hidden[:, : int(covered.max())]
    return hidden * masked_frames(covered, hidden.shape[1])[..., None], covered


class SALM(nn.Module):
    """Encoder + adapter + ``SpeechLMLoss`` (see the module docstring)."""

    def __init__(
        self,
        encoder: nn.Module,
        adapter: nn.Module,
        llm: SpeechLMLoss,
        cfg: SpeechConfig,
        front,
        ctc_head: nn.Linear | None = None,
    ):
        super().__init__()
        self.encoder, self.adapter, self.llm = encoder, adapter, llm
        self.ctc_head = ctc_head  # encoder width -> vocabulary + blank, with model.speech.ctc_weight
        self.cfg = cfg
        self.front = front  # features, frame counts of this encoder kind (``front_end``)
        self.config = llm.config  # the LLM's (parallelize / metrics read model.config)
        self.augment_generator: torch.Generator | None = None  # SpecAugment's stream (set per rank)

    def audio_slots(self, audio_lens: torch.Tensor) -> torch.Tensor:
        """Adapter frames of each utterance, from its sample count alone."""
        return self.adapter.output_lengths(self.front.output_frames(self.encoder, audio_lens))

    def encoder_frames(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's frames ``[B, T, H]`` (zero past each utterance's audio) and each utterance's count."""
        return encoder_frames(self, audio, audio_lens)

    def adapt(self, hidden: torch.Tensor, covered: torch.Tensor) -> torch.Tensor:
        """The valid adapter frames of every utterance, concatenated in batch order: ``[sum(slots), H]``."""
        adapted = self.adapter(hidden)
        slots = self.adapter.output_lengths(covered)
        return adapted[masked_frames(slots, adapted.shape[1])]

    def encode(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> torch.Tensor:
        return self.adapt(*self.encoder_frames(audio, audio_lens))

    def forward(
        self,
        audio: torch.Tensor,
        audio_lens: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None,
        audio_mask: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        hidden, covered = self.encoder_frames(audio, audio_lens)
        loss = self.llm(
            input_ids,
            labels,
            audio_embeds=self.adapt(hidden, covered),
            audio_mask=audio_mask,
            position_ids=position_ids,
        )
        # the CTC loss's head: the model's own, or a CTCBridge's (which then keeps learning the token posteriors)
        head = self.adapter.head if self.ctc_head is None and isinstance(self.adapter, CTCBridge) else self.ctc_head
        if head is not None and self.cfg.ctc_weight > 0 and self.training and labels is not None:
            loss = loss + self.cfg.ctc_weight * ctc_loss_sum(head(hidden), covered, labels)
        return loss


def transcript_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's answer tokens from the SALM labels (their labelled positions are the answer then its eos, one
    run at the end of the row: ``headrace.training.speech.prompt.build_batch``): padded targets ``[B, L]``
    (values past a row's length are any valid token) and the lengths, without the eos."""
    labelled = labels != IGNORE_INDEX
    start = labelled.int().argmax(1)
    index = (start[:, None] + torch.arange(labels.shape[1], device=labels.device)).clamp(max=labels.shape[1] - 1)
    return labels.gather(1, index).clamp(min=0), (labelled.sum(1) - 1).clamp(min=0)


def ctc_loss_sum(logits: torch.Tensor, frames: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed CTC loss of the transcripts over the encoder frames (``logits`` ``[B, T, V + 1]``, blank = ``V``).
    An utterance with more tokens than frames contributes 0 (``zero_infinity``). ``ctc_loss`` reads the lengths
    on the host: one sync per micro-batch on a GPU."""
    return ctc_targets_loss_sum(logits, frames, *transcript_targets(labels))


def ctc_targets_loss_sum(
    logits: torch.Tensor, frames: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Summed CTC loss of padded ``targets`` ``[B, L]`` (``lengths`` each) over ``frames`` frames of ``logits``
    ``[B, T, V + 1]`` (blank = ``V``, the last class); see ``ctc_loss_sum``."""
    log_probs = logits.float().log_softmax(-1).transpose(0, 1)
    return nn.functional.ctc_loss(
        log_probs, targets, frames, lengths, blank=logits.shape[-1] - 1, reduction="sum", zero_infinity=True
    )


def build_meta_salm(llm_config: PretrainedConfig, cfg: SpeechConfig) -> SALM:
    """The whole SALM on the meta device (fp32 master weights), frozen parts marked."""
    front = front_end(cfg.encoder.kind, cfg.features)
    enc_config = front.config(cfg.encoder)
    llm = build_meta_model(llm_config)
    with torch.device("meta"):
        with refused_as("model.speech.encoder.config"):  # e.g. a subsampling_factor of 0
            encoder = front.build(enc_config)
        adapter = build_adapter(cfg.adapter, enc_config.hidden_size, llm_config.hidden_size, llm_config.vocab_size)
        bridged = isinstance(adapter, CTCBridge)
        ctc_head = (
            nn.Linear(enc_config.hidden_size, llm_config.vocab_size + 1) if cfg.ctc_weight > 0 and not bridged else None
        )
    model = SALM(encoder, adapter, SpeechLMLoss(llm), cfg, front, ctc_head)
    model.llm.token_mass = bridged
    for part, frozen in ((encoder, cfg.encoder.freeze), (adapter, cfg.adapter.freeze), (model.llm, cfg.freeze_llm)):
        if frozen:  # (not requires_grad_(True) otherwise: Whisper's sinusoidal positions stay fixed)
            part.requires_grad_(False)
    return model


@torch.no_grad()
def materialize_salm(model: SALM, device: torch.device, llm_path: str | None) -> None:
    """Allocate each rank's shards, initialize, then load whatever has a local checkpoint (a part's own directory,
    or a whole model's checkpoint whose part it reads: ``headrace.training.speech.checkpoints``)."""
    materialize(model.llm, device, llm_path, prefix=part_prefix(llm_path, "hf") if llm_path else "")
    model.encoder.to_empty(device=device)
    model.adapter.to_empty(device=device)
    for module in model.encoder.modules():
        module._is_hf_initialized = False
    model.front.initialize(model.encoder)
    model.adapter.reset_parameters()
    if model.ctc_head is not None:  # a training aid: never exported, always fresh
        model.ctc_head.to_empty(device=device)
        model.ctc_head.reset_parameters()
    if path := model.cfg.encoder.pretrained_path:
        load_safetensors(model.encoder, path, prefix=model.front.checkpoint_prefix(path))
    if path := model.cfg.adapter.pretrained_path:
        load_safetensors(
            model.adapter, path, prefix=part_prefix(path, "adapter"), rename=lambda name: salm_name("adapter", name)
        )
    elif path := model.cfg.adapter.head_path:  # a fresh bridge over a CTC stage's head (its units: tokens)
        load_safetensors(model.adapter.head, path)


__all__ = [
    "SALM",
    "Adapter",
    "LinearAdapter",
    "SpeechLMLoss",
    "build_adapter",
    "build_meta_salm",
    "ctc_loss_sum",
    "ctc_targets_loss_sum",
    "encoder_frames",
    "materialize_salm",
    "transcript_targets",
]
