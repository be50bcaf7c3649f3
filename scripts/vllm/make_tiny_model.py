#!/usr/bin/env python3
r"""Make a tiny, randomly initialised Qwen2 causal LM with its own tokenizer, fully offline.

The result is a Hugging Face model folder that vLLM serves (``--tool-call-parser hermes``) and that
transformers loads for training:

* ``config.json`` / ``model.safetensors`` / ``generation_config.json``: Qwen2, hidden 128, 2 layers,
  4 heads (2 KV heads), vocab 4096, untied embeddings, float32, random init from ``--seed``.
* ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``: a byte-level BPE trained
  with ``tokenizers`` on a corpus this script generates (English-like prose, JSON, code and shell
  snippets, and chat transcripts rendered with the model's own template, tool calls included), plus
  the ChatML / hermes tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos),
  ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``.

The chat template is hermes style (as Qwen2.5): tools are listed as JSON inside ``<tools></tools>``
in the system prompt, the assistant calls them as
``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` and tool results come back as
``<tool_response>`` blocks in a user turn.

Everything is deterministic: the tokenizer depends only on ``TOKENIZER_SEED`` and the corpus recipe,
the weights only on ``--seed`` (and the torch version). A complete output folder is detected by its
``openforge-tiny-model.json`` stamp and left alone, so reruns are no-ops.

Usage::

    python make_tiny_model.py OUT_DIR [--seed 0] [--force]

Needs torch, transformers (4.4x or 5.x), tokenizers and jinja2; no network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RECIPE = "openforge-tiny-qwen2/2"
STAMP_FILE = "openforge-tiny-model.json"
TOKENIZER_SEED = 1234
VOCAB_SIZE = 4096
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    # Untied: vLLM's CPU build packs the output projection for its matmul kernel at load time and,
    # when it is tied to the input embedding, an in-place weight reload updates the embedding but
    # not that packed copy, so a published checkpoint would be served with a stale output layer.
    # A separate lm_head is reloaded and repacked like every other linear layer.
    "tie_word_embeddings": False,
}

QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Control tokens: skipped when decoding with skip_special_tokens.
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
# Single tokens that must stay visible in decoded text, or the hermes parser cannot see them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part.type == 'text' -%}{{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_message = render_content(messages[0].content) -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set system_message = none -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if system_message is not none -%}{{- system_message + '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\\n' -}}{{- tool | tojson -}}
    {%- endfor -%}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' -}}
    {{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif system_message is not none -%}
    {{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {{- '<|im_start|>assistant' -}}
        {%- set text = render_content(message.content) -%}
        {%- if text -%}{{- '\\n' + text -}}{%- endif -%}
        {%- if message.tool_calls -%}
            {%- for tool_call in message.tool_calls -%}
                {%- if tool_call.function is defined -%}
                    {%- set tool_call = tool_call.function -%}
                {%- endif -%}
                {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' -}}
                {%- if tool_call.arguments is string -%}
                    {{- tool_call.arguments -}}
                {%- else -%}
                    {{- tool_call.arguments | tojson -}}
                {%- endif -%}
                {{- '}\\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# fmt: off
WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or
had by hot word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water than
call first who may down side been now find any new work part take get place made live where after
back little only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy old too same
tell does set three want air well also play small end put home read hand port large spell add even
land here must big high such follow act why ask men change went light kind off need house picture try
us again animal point mother world near build self earth father head stand own page should country
found answer school grow study still learn plant cover food sun four between state keep eye never last
let thought city tree cross farm hard start might story saw far sea draw left late run while press
close night real life few north open seem together next white children begin got walk example ease
paper group always music those both mark often letter until mile river car feet care second book carry
took science eat room friend began idea fish mountain stop once base hear horse cut sure watch color
face wood main enough plain girl usual young ready above ever red list though feel talk bird soon body
dog family direct pose leave song measure door product black short numeral class wind question happen
complete ship area half rock order fire south problem piece told knew pass since top whole king space
heard best hour better true during hundred five remember step early hold west ground interest reach
fast verb sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice voice
unit power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field
rest correct able pound done beauty drive stood contain front teach week final gave green oh quick
develop ocean warm free minute strong special mind behind clear tail produce fact street inch multiply
nothing course stay wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate
miss brought heat snow tire bring yes distant fill east paint language among file function error value
result return request response server client model token weather search query task tool message user
assistant content data input output string integer boolean array object true false null path directory
command shell run build install package version update delete create list read write open close status
""".split()  # noqa: SIM905 - a word list reads best as text
TOOL_SPECS = [
    ("get_weather", "Get the current weather for a city.", {"city": "string", "unit": "string"}),
    ("read_file", "Read a text file and return its content.", {"path": "string"}),
    ("write_file", "Write text to a file.", {"path": "string", "content": "string"}),
    ("run_shell", "Run a shell command and return its output.", {"command": "string", "timeout": "integer"}),
    ("search", "Search the web for a query.", {"query": "string", "max_results": "integer"}),
    ("calculator", "Evaluate an arithmetic expression.", {"expression": "string"}),
    ("add", "Add two numbers.", {"a": "number", "b": "number"}),
    ("multiply", "Multiply two numbers.", {"a": "number", "b": "number"}),
    ("list_dir", "List the files in a directory.", {"path": "string", "recursive": "boolean"}),
    ("send_email", "Send an email.", {"to": "string", "subject": "string", "body": "string"}),
    ("lookup", "Look up a key in the store.", {"key": "string"}),
    ("echo", "Return the text unchanged.", {"text": "string"}),
]
CITIES = ["Paris", "London", "Berlin", "Tokyo", "New York", "Madrid", "Rome", "Oslo", "Cairo", "Lima"]
SHELL = ["ls -la", "cat README.md", "git status", "git diff", "python -m pytest -q", "grep -rn TODO src",
         "pip install -e .", "make test", "echo hello", "pwd", "cd src && ls", "wc -l *.py", "head -n 20 log.txt",
         "find . -name '*.py'", "npm test", "cargo build", "go test ./...", "rm -rf build", "mkdir -p out"]
CODE = [
    "def {f}({a}, {b}):\n    return {a} + {b}\n",
    "import json\n\nwith open({s}) as fh:\n    data = json.load(fh)\nprint(data[{s}])\n",
    "for i in range({n}):\n    if i % 2 == 0:\n        print(i)\n",
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n\n"
    "    def __repr__(self):\n        return f\"{F}({{self.{a}}})\"\n",
    "async def {f}(client, {a}):\n    resp = await client.get({s})\n"
    "    resp.raise_for_status()\n    return resp.json()\n",
    "const {a} = require({s});\nfunction {f}({b}) {{\n  return {a}.{f}({b});\n}}\nmodule.exports = {{ {f} }};\n",
    "if __name__ == \"__main__\":\n    import sys\n    sys.exit({f}(sys.argv[1:]))\n",
    "try:\n    {a} = {f}({b})\nexcept ValueError as exc:\n    raise RuntimeError({s}) from exc\n",
]
# fmt: on


def _word(rng: random.Random) -> str:
    if rng.random() < 0.9:
        return rng.choice(WORDS)
    syll = ["ka", "ro", "mi", "te", "lun", "sar", "po", "ven", "di", "qua", "zel", "bo", "ri", "tan"]
    return "".join(rng.choice(syll) for _ in range(rng.randint(2, 4)))


def _sentence(rng: random.Random, lo: int = 4, hi: int = 18) -> str:
    words = [_word(rng) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 2000)))
    if rng.random() < 0.15:
        words.insert(rng.randrange(len(words)), rng.choice(CITIES))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ":", ","])


def _paragraph(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(1, 5)))


def _ident(rng: random.Random) -> str:
    return "_".join(rng.choice(WORDS).lower().replace("'", "") for _ in range(rng.randint(1, 3)))


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.random()
    if depth < 2 and kind < 0.15:
        return {_ident(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}
    if depth < 2 and kind < 0.25:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind < 0.55:
        return " ".join(_word(rng) for _ in range(rng.randint(1, 6)))
    if kind < 0.75:
        return rng.randint(-100, 10000)
    if kind < 0.85:
        return round(rng.uniform(-100, 100), rng.randint(1, 4))
    return rng.choice([True, False, None])


def _json_text(rng: random.Random) -> str:
    obj = {_ident(rng): _json_value(rng) for _ in range(rng.randint(1, 6))}
    style = rng.random()
    if style < 0.5:
        return json.dumps(obj, ensure_ascii=False)
    if style < 0.8:
        return json.dumps(obj, ensure_ascii=False, indent=2)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _code(rng: random.Random) -> str:
    tmpl = rng.choice(CODE)
    return tmpl.format(
        f=_ident(rng),
        F=_ident(rng).title().replace("_", ""),
        a=rng.choice(WORDS).lower(),
        b=rng.choice(WORDS).lower() + "s",
        s=json.dumps(_word(rng)),
        n=rng.randint(1, 100),
    )


def _tool_schema(name: str, desc: str, params: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t, "description": f"The {k}."} for k, t in params.items()},
                "required": list(params)[:1],
            },
        },
    }


def _tool_args(rng: random.Random, params: dict[str, str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for key, typ in params.items():
        if rng.random() < 0.3 and args:
            continue
        if key == "city":
            args[key] = rng.choice(CITIES)
        elif key == "command":
            args[key] = rng.choice(SHELL)
        elif key == "path":
            args[key] = "/".join(_ident(rng) for _ in range(rng.randint(1, 3))) + rng.choice(
                [".py", ".md", ".txt", ".json", ""]
            )
        elif typ == "integer":
            args[key] = rng.randint(1, 60)
        elif typ == "number":
            args[key] = rng.choice([rng.randint(-50, 500), round(rng.uniform(-50, 500), 2)])
        elif typ == "boolean":
            args[key] = rng.random() < 0.5
        else:
            args[key] = " ".join(_word(rng) for _ in range(rng.randint(1, 6)))
    return args


def _conversation(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    specs = rng.sample(TOOL_SPECS, rng.randint(1, 4)) if rng.random() < 0.6 else []
    tools = [_tool_schema(*s) for s in specs] or None
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        msgs.append({"role": "system", "content": _sentence(rng, 4, 12)})
    for turn in range(rng.randint(1, 3)):
        msgs.append(
            {
                "role": "user",
                "content": _paragraph(rng)
                if turn or rng.random() < 0.5
                else rng.choice(["What is ", "Please ", "Can you ", "Run ", "Find "]) + _sentence(rng, 2, 8),
            }
        )
        if specs and rng.random() < 0.7:
            calls = []
            for _ in range(rng.randint(1, 2)):
                name, _desc, params = rng.choice(specs)
                calls.append(
                    {
                        "id": f"call_{rng.getrandbits(48):012x}",
                        "type": "function",
                        "function": {"name": name, "arguments": _tool_args(rng, params)},
                    }
                )
            content = _sentence(rng) if rng.random() < 0.2 else None
            msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
            for call in calls:
                result = _json_text(rng) if rng.random() < 0.6 else _sentence(rng)
                msgs.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        msgs.append({"role": "assistant", "content": _paragraph(rng)})
    return msgs, tools


def _render(template: Any, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return str(template.render(messages=msgs, tools=tools, add_generation_prompt=False))


def _jinja_template() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(CHAT_TEMPLATE)


def corpus(seed: int = TOKENIZER_SEED, n_chats: int = 6000, n_docs: int = 12000) -> Iterator[str]:
    """Yield training text: chat transcripts (special tokens cut out), prose, JSON, code, shell."""
    rng = random.Random(seed)
    template = _jinja_template()
    cut = SPECIAL_TOKENS
    for _ in range(n_chats):
        text = _render(template, *_conversation(rng))
        for tok in cut:
            text = text.replace(tok, "\x00")
        yield from (piece for piece in text.split("\x00") if piece)
    for _ in range(n_docs):
        r = rng.random()
        if r < 0.45:
            yield _paragraph(rng)
        elif r < 0.7:
            yield _json_text(rng)
        elif r < 0.9:
            yield _code(rng)
        else:
            yield "$ " + rng.choice(SHELL) + "\n" + _sentence(rng)


def train_tokenizer() -> Any:
    """Train the byte-level BPE and return a ``tokenizers.Tokenizer`` of exactly VOCAB_SIZE tokens."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    # The same normalizer and pre-tokenizer as Qwen2's tokenizer: transformers 5 rebuilds this
    # pipeline for any model_type "qwen2" folder, so anything else would encode differently there.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - n_added,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bpe_size = tok.get_vocab_size()
    if bpe_size != VOCAB_SIZE - n_added:
        raise RuntimeError(f"BPE reached {bpe_size} tokens, wanted {VOCAB_SIZE - n_added}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    return tok


def build(out: Path, seed: int) -> dict[str, Any]:
    """Write the model folder into ``out`` (which must not exist) and return its summary."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    t0 = time.monotonic()
    raw = train_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: raw.token_to_id(t) for t in SPECIAL_TOKENS + TOOL_TOKENS}
    t_tok = time.monotonic() - t0

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
        **MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config.bos_token_id = ids[PAD_TOKEN]
    model.generation_config.eos_token_id = [ids[IM_END], ids[PAD_TOKEN]]
    model.generation_config.pad_token_id = ids[PAD_TOKEN]
    n_params = sum(p.numel() for p in model.parameters())

    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _make_portable(out)

    # Round trip: the saved folder must render and encode a tool conversation as expected.
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out)
    msgs, tools = _conversation(random.Random(7))
    text = reloaded.apply_chat_template(msgs, tools=tools, tokenize=False)
    enc = reloaded(text, add_special_tokens=False)["input_ids"]
    if reloaded.decode(enc) != text:
        raise RuntimeError("tokenizer round trip changed the text")
    for tok_text in (IM_START, IM_END, *TOOL_TOKENS[:2]):
        if reloaded.convert_tokens_to_ids(tok_text) != ids[tok_text]:
            raise RuntimeError(f"{tok_text} is not a single token after reload")

    summary = {
        "recipe": RECIPE,
        "seed": seed,
        "tokenizer_seed": TOKENIZER_SEED,
        "parameters": n_params,
        "vocab_size": VOCAB_SIZE,
        "token_ids": ids,
        "shape": MODEL_SHAPE,
        "dtype": "float32",
        "sample_chars_per_token": round(len(text) / len(enc), 2),
        "versions": {
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"),
        },
        "seconds": {"tokenizer": round(t_tok, 1), "total": round(time.monotonic() - t0, 1)},
        "files": {},
    }
    for path in sorted(out.iterdir()):
        if path.is_file():
            summary["files"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (out / STAMP_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def _make_portable(out: Path) -> None:
    """Make the folder load the same way in transformers 4.x and 5.x.

    transformers 5 names its tokenizer class ``TokenizersBackend`` (unknown to 4.x) and keeps the
    chat template only in ``chat_template.jinja`` (4.x before 4.50 reads it from
    ``tokenizer_config.json``); its config carries ``rope_parameters`` where 4.x reads ``rope_theta``.
    """
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", "utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for path in out.iterdir():
        path.chmod(0o644)


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def is_complete(out: Path, seed: int) -> bool:
    """True when ``out`` holds a finished model of this recipe and seed."""
    try:
        stamp = json.loads((out / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        stamp.get("recipe") == RECIPE
        and stamp.get("seed") == seed
        and all((out / name).is_file() for name in stamp.get("files", {}))
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="model folder to create")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete model is already there")
    args = parser.parse_args(argv)
    out: Path = args.out_dir.resolve()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    if not args.force and is_complete(out, args.seed):
        print(f"[tiny-model] {out} is complete (seed {args.seed}); nothing to do", file=sys.stderr)
        return 0
    if out.exists() and any(out.iterdir()) and not args.force and not (out / STAMP_FILE).exists():
        parser.error(f"{out} exists, is not empty and is not a tiny model; use --force")

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then swap it in: a crash never leaves a half-written model at OUT_DIR.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        print(f"[tiny-model] building {out} (seed {args.seed})", file=sys.stderr)
        summary = build(tmp / "model", args.seed)
        if out.exists():
            shutil.rmtree(out)
        (tmp / "model").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"[tiny-model] wrote {out}: {summary['parameters']} parameters, vocab {VOCAB_SIZE}, "
        f"{summary['sample_chars_per_token']} chars/token on a sample chat, "
        f"{summary['seconds']['total']} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
