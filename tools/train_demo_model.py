"""Train the small demo checkpoint that ships in demo_model/.

Usage (from the repository root, CPU only; under ten minutes on 2 idle cores):

    python -m tools.train_demo_model --out demo_model

The script trains a byte-level BPE tokenizer and a tiny LlamaForCausalLM on
passages of the Python language reference (tools/demo_corpus.py), until the
model has memorised them. It then writes a standard Hugging Face checkpoint
directory plus prompts.json: demo prompts that share a long common prefix and
whose greedy continuation reproduces the reference text.

Everything is seeded and runs in a fixed order, so a rerun with the same
Python, torch and transformers versions on the same kind of CPU gives the
same checkpoint.
"""

import argparse
import json
import math
import os
import random
import re
import sys
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tools import demo_corpus

BOS, EOS = "<|bos|>", "<|eos|>"
VOCAB_SIZE = 2048
MAX_POSITIONS = 1024
ROW_TOKENS = 832          # packed training rows are at most this long
PROMPT_MIN_TOKENS = 16    # passage tokens kept in a prompt, at least
EXPECTED_TOKENS = 40      # reference continuation stored for each prompt
CHECK_TOKENS = 20         # tokens a prompt must reproduce to be kept
MIN_MARGIN = 0.5          # smallest top-1 over top-2 logit gap to keep a prompt
STOP_MARGIN = 3.0         # training stops once every prompt has this margin
CHECK_FROM_EPOCH = 20     # no point checking for memorisation earlier


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_model", help="checkpoint directory to write")
    parser.add_argument("--epochs", type=int, default=80,
                        help="most passes over the training rows (training stops once memorised)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser.parse_args()


def make_reproducible(seed, threads):
    """Fix every source of randomness and the thread count."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


# ----------------------------------------------------------------- tokenizer

def train_tokenizer():
    """Train a byte-level BPE on all help topics; BOS is added on encode."""
    tok = Tokenizer(models.BPE())
    # Byte level on both sides: every string encodes, and decode restores spaces.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(demo_corpus.tokenizer_texts(), trainer=trainer)
    # Like Llama tokenizers: encoding a prompt starts it with BOS, as in training.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def wrap_tokenizer(tok):
    """Wrap the raw tokenizer so save_pretrained/AutoTokenizer work."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
        model_max_length=MAX_POSITIONS)


def encode(tok, text):
    """Token ids of text without the BOS the post-processor adds."""
    return tok.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------- data

def prompt_documents(tok):
    """Return (topic, ids) of shared prefix + passage for each prompt topic.

    The prefix ends in one newline and each passage starts with one, so the
    prefix tokens are the same in every document (checked here).
    """
    prefix = demo_corpus.shared_prefix()
    prefix_ids = encode(tok, prefix)
    docs = []
    for name in demo_corpus.PROMPT_TOPICS:
        ids = encode(tok, prefix + "\n" + demo_corpus.passage(name))
        assert ids[:len(prefix_ids)] == prefix_ids, f"prefix tokens differ for {name}"
        docs.append((name, ids))
    return prefix_ids, docs


def standalone_documents(tok):
    """Return the ids of each training topic on its own."""
    return [encode(tok, demo_corpus.passage(name)) for name in demo_corpus.training_topics()]


def pack_rows(docs, bos, eos, row_tokens):
    """Greedily pack BOS+doc+EOS sequences, in order, into rows of bounded length."""
    rows, current = [], []
    for ids in docs:
        seq = [bos] + ids[:row_tokens - 2] + [eos]
        if current and len(current) + len(seq) > row_tokens:
            rows.append(current)
            current = []
        current = current + seq
    if current:
        rows.append(current)
    return rows


def training_rows(tok):
    """All training rows: each prompt document alone, standalone topics packed."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    _, prompt_docs = prompt_documents(tok)
    rows = [[bos] + ids[:ROW_TOKENS - 2] + [eos] for _, ids in prompt_docs]
    rows += pack_rows(standalone_documents(tok), bos, eos, ROW_TOKENS)
    return rows


def collate(rows, pad_id, width=ROW_TOKENS):
    """Right-pad rows to a fixed width; padded labels are ignored.

    Causal attention means real tokens never see the padding after them. A
    fixed width keeps tensor shapes constant, which is several times faster
    on CPU than letting every batch have its own length.
    """
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, :len(row)] = torch.tensor(row)
    return ids, labels


# --------------------------------------------------------------------- model

def make_model(tok):
    """A ~3.7M-parameter Llama: 4 layers, hidden 256, 4 heads of 64."""
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(EOS),
    )
    return LlamaForCausalLM(config)


def lr_at(step, total, peak, warmup=30):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model, rows, args, pad_id, candidates):
    """Plain AdamW loop over shuffled rows, until the candidates are memorised.

    Returns (epochs run, mean loss of the last epoch).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    order_rng = torch.Generator().manual_seed(args.seed)
    steps_per_epoch = math.ceil(len(rows) / args.batch_size)
    total = steps_per_epoch * args.epochs
    model.train()
    step, start, epoch_loss = 0, time.time(), float("nan")
    for epoch in range(args.epochs):
        order = torch.randperm(len(rows), generator=order_rng).tolist()
        losses = []
        for b in range(0, len(order), args.batch_size):
            ids, labels = collate([rows[i] for i in order[b:b + args.batch_size]], pad_id)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, args.lr)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
        epoch_loss = sum(losses) / len(losses)
        if epoch % 5 == 4:  # every 5 epochs: log, and stop once memorised
            margin = memorisation_margin(model, candidates) if epoch + 1 >= CHECK_FROM_EPOCH else float("nan")
            print(f"epoch {epoch + 1:3d}  step {step:4d}  loss {epoch_loss:.4f}  "
                  f"margin {margin:6.2f}  {time.time() - start:6.0f}s", flush=True)
            model.train()
            if margin >= STOP_MARGIN:
                break
    model.eval()
    return epoch + 1, epoch_loss


@torch.no_grad()
def memorisation_margin(model, candidates):
    """Smallest teacher-forced logit margin of the expected tokens over all prompts.

    Negative when some expected token is not the model's top choice. One
    forward per prompt, much cheaper than generating.
    """
    model.eval()
    worst = float("inf")
    for cand in candidates:
        prompt, expected = cand["prompt_ids"], cand["expected_ids"][:CHECK_TOKENS]
        logits = model(input_ids=torch.tensor([prompt + expected])).logits[0]
        logits = logits[len(prompt) - 1:len(prompt) - 1 + len(expected)]
        target = logits.gather(1, torch.tensor(expected)[:, None])[:, 0]
        others = logits.scatter(1, torch.tensor(expected)[:, None], float("-inf"))
        worst = min(worst, (target - others.max(dim=1).values).min().item())
    return worst


# ------------------------------------------------------------------- prompts

def cut_index(tok, doc_ids, start):
    """First index >= start where the passage can be cut cleanly.

    The next token must begin a new word, and decoding then re-encoding the
    prompt must give back the same ids, so a text prompt tokenizes the same.
    """
    for cut in range(start, len(doc_ids) - CHECK_TOKENS):
        if not tok.id_to_token(doc_ids[cut]).startswith("\u0120"):  # "Ġ" marks a leading space
            continue
        text = tok.decode(doc_ids[:cut])
        if encode(tok, text) == doc_ids[:cut]:
            return cut
    return None


def candidate_prompts(tok):
    """Build one prompt per prompt topic: prefix + start of its passage."""
    bos = tok.token_to_id(BOS)
    prefix_ids, docs = prompt_documents(tok)
    candidates = []
    for name, ids in docs:
        cut = cut_index(tok, ids, len(prefix_ids) + PROMPT_MIN_TOKENS)
        if cut is None:
            continue
        prompt_ids = [bos] + ids[:cut]
        expected_ids = ids[cut:cut + EXPECTED_TOKENS]
        candidates.append({
            "topic": name,
            "prompt": tok.decode(ids[:cut]),
            "expected": tok.decode(expected_ids),
            "prompt_ids": prompt_ids,
            "expected_ids": expected_ids,
        })
    return candidates


@torch.no_grad()
def greedy_check(model, prompt_ids, expected_ids):
    """Greedy-decode len(expected_ids) tokens; return (matched prefix, min margin)."""
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=len(expected_ids), min_new_tokens=len(expected_ids),
        do_sample=False, output_scores=True, return_dict_in_generate=True)
    generated = out.sequences[0, len(prompt_ids):].tolist()
    matched = 0
    while matched < len(expected_ids) and generated[matched] == expected_ids[matched]:
        matched += 1
    margins = [(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item()
               for s in out.scores[:CHECK_TOKENS]]
    return matched, min(margins)


def select_prompts(model, candidates):
    """Keep prompts whose first CHECK_TOKENS greedy tokens match with margin."""
    kept = []
    for cand in candidates:
        matched, margin = greedy_check(model, cand["prompt_ids"], cand["expected_ids"])
        ok = matched >= CHECK_TOKENS and margin >= MIN_MARGIN
        print(f"prompt {cand['topic']:10s} matched {matched:2d}/{len(cand['expected_ids'])}"
              f"  min margin {margin:5.2f}  {'kept' if ok else 'dropped'}", flush=True)
        if ok:
            kept.append(dict(cand, matched_tokens=matched))
    return kept


# ---------------------------------------------------------------------- save

def save_checkpoint(out, model, tok, prompts, shared_prefix):
    """Write model, tokenizer, generation config and prompts.json to out."""
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    wrap_tokenizer(tok).save_pretrained(out)
    name_tokenizer_class(out)
    GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id, do_sample=False, max_new_tokens=64,
    ).save_pretrained(out)
    write_prompts(os.path.join(out, "prompts.json"), {
        "source": "Python reference help topics from CPython's pydoc_data.topics "
                  f"(Python {sys.version.split()[0]}), Python Software Foundation License",
        "shared_prefix": shared_prefix,
        "check_tokens": CHECK_TOKENS,
        "prompts": prompts,
    })


def write_prompts(path, data):
    """Write indented JSON, but keep each list of token ids on one line."""
    text = json.dumps(data, indent=1, ensure_ascii=False)
    text = re.sub(r"\[\s*(\d+(?:,\s*\d+)*)\s*\]",
                  lambda m: "[" + ", ".join(re.findall(r"\d+", m.group(1))) + "]", text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def name_tokenizer_class(out):
    """Name the generic fast tokenizer class, which transformers 4 and 5 both load."""
    path = os.path.join(out, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def make_readable(out):
    """Give every written file the usual rw-r--r-- mode (safetensors writes 0600)."""
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o644)


def main():
    args = parse_args()
    start = time.time()
    make_reproducible(args.seed, args.threads)
    tok = train_tokenizer()
    rows = training_rows(tok)
    print(f"{len(rows)} rows, {sum(map(len, rows))} tokens per epoch", flush=True)
    model = make_model(tok)
    print(f"{sum(p.numel() for p in model.parameters())} parameters", flush=True)
    candidates = candidate_prompts(tok)
    epochs, loss = train(model, rows, args, tok.token_to_id(EOS), candidates)
    prompts = select_prompts(model, candidates)
    save_checkpoint(args.out, model, tok, prompts, demo_corpus.shared_prefix())
    make_readable(args.out)
    print(f"{epochs} epochs, final loss {loss:.4f}; kept {len(prompts)} of {len(candidates)} "
          f"prompts; total {time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
