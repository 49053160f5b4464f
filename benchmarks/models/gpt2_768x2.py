"""Issue 46's repro shape: GPT-2 width 768, 2 blocks, 12 heads, 128 tokens (vocabulary
1024 to keep the CPU probes short), random init; next-token loss."""
import torch
import torch.nn.functional as F

MODEL_NAME = "gpt2_768x2"


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=1024, n_embd=768, n_layer=2, n_head=12, n_positions=128,
                     use_cache=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def _batches(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (4, 128), generator=g) for _ in range(n)]


def calibration_data():
    return _batches(1, 2)


def eval_data():
    return _batches(2, 2)


def forward(model, batch):
    return model(input_ids=batch).logits


def loss(outputs, batch):
    return F.cross_entropy(outputs[:, :-1].float().flatten(0, 1), batch[:, 1:].flatten())
