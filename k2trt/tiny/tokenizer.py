"""A tiny Kimi-format tokenizer for the embedded synthetic checkpoint.

Trains a byte-level BPE on a small built-in corpus and writes the same files a real Kimi K2 directory
has (tiktoken.model, tokenizer_config.json, special_tokens_map.json, and tokenization_kimi.py, the
transformers tokenizer class its auto_map names: k2trt's own, k2trt/tiny/tokenization_kimi.py), so the runtime
loads both with one code path, and transformers' AutoTokenizer (trust_remote_code) loads the tiny's too.
Deterministic: the same num_base_tokens always gives byte-identical files.
"""

from __future__ import annotations

import base64
import heapq
import json
import re
from collections import Counter
from pathlib import Path

from k2trt.atomic import atomic_write_text
from k2trt.errors import K2Error
from k2trt.runtime.text.tokenizer import CONFIG_FILE, NUM_RESERVED_SPECIAL, RANKS_FILE, TEMPLATE_FILE, reserved_name

# The transformers tokenizer written beside the files (its source is this package's module of the same name), and
# the class tokenizer_config.json's auto_map and tokenizer_class name, as in K2's releases.
CODE_FILE = "tokenization_kimi.py"
CODE_CLASS = "TikTokenTokenizer"

# Kimi K2's named special ids, as offsets from the number of base tokens (163584 in K2); the rest are reserved slots.
# Every release names 0-4, 6, 7, 9-15, 17, 254 and 255 (K2-Instruct-0905's tokenizer_config.json: 163584..163601,
# 163838, 163839); 11-15 are the tool-call markers.
SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}
# The thinking releases (K2-Thinking, K2.5) add <think> and </think> (163606, 163607) and ship their template as
# chat_template.jinja.
THINK_OFFSETS = {22: "<think>", 23: "</think>"}

# The templates render what the released ones render (K2-Instruct's in tokenizer_config.json, K2-Thinking's and
# K2.5's chat_template.jinja), written here from that behaviour:
# - `tools` first, as one turn <|im_system|>tool_declare<|im_middle|>{tools as JSON}<|im_end|>;
# - a default system turn when the first message is not a system one;
# - each message <|im_{user|assistant|system}|>{name or role}<|im_middle|>{body}<|im_end|>; a tool result is a
#   system-marked turn whose body is "## Return of {tool_call_id}\n{content}";
# - an assistant turn with tool_calls: its content, then <|tool_calls_section_begin|>, per call
#   <|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>, <|tool_calls_section_end|>;
# - the thinking releases: every assistant turn opens with its thinking, <think>{reasoning_content}</think>, kept
#   only after the last assistant turn without tool calls (the turns of the current round, tool calls included),
#   empty before it; K2-Thinking's generation prompt leaves <think> to the model, K2.5's opens it, or closes it at
#   once when chat_template_kwargs say {"thinking": false}.
# No BOS. Whitespace control (-) keeps the source layout out of the output, so it renders the same with or without
# trim_blocks/lstrip_blocks. The templates are made of these pieces:
_TOOLS = """\
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>
{%- endif -%}
"""
_DEFAULT_SYSTEM = """\
{%- if not messages or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>@SYSTEM@<|im_end|>
{%- endif -%}
"""
_ROLE = """\
  {%- if message['role'] == 'user' -%}
<|im_user|>
  {%- elif message['role'] == 'assistant' -%}
<|im_assistant|>
  {%- else -%}
<|im_system|>
  {%- endif -%}
{{- message.get('name') or message['role'] -}}
<|im_middle|>
"""
_TEXT = """\
  {%- set content = message.get('content') -%}
  {%- if content is string -%}
{{- content -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}
      {%- if part['type'] == 'text' -%}
{{- part['text'] -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
"""
_BODY = """\
  {%- if message['role'] == 'tool' -%}
## Return of {{ message.get('tool_call_id') }}
{{ '' -}}
  {%- endif -%}
""" + _TEXT + """\
  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
<|tool_calls_section_begin|>
    {%- for call in message['tool_calls'] -%}
<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
      {%- if call['function']['arguments'] is string -%}
{{- call['function']['arguments'] -}}
      {%- else -%}
{{- call['function']['arguments'] | tojson -}}
      {%- endif -%}
<|tool_call_end|>
    {%- endfor -%}
<|tool_calls_section_end|>
  {%- endif -%}
<|im_end|>
"""
_GENERATION_PROMPT = """\
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""
CHAT_TEMPLATE = (_TOOLS + _DEFAULT_SYSTEM.replace("@SYSTEM@", "You are a helpful assistant")
                 + "{%- for message in messages -%}\n" + _ROLE + _BODY + "{%- endfor -%}\n" + _GENERATION_PROMPT)

_THINK = """\
  {%- if message['role'] == 'assistant' -%}
    {%- if loop.index0 > ns.last_answer -%}
<think>{{- message.get('reasoning_content') or '' -}}</think>
    {%- else -%}
<think></think>
    {%- endif -%}
  {%- endif -%}
"""
_THINKING_BODY = (_TOOLS + _DEFAULT_SYSTEM.replace("@SYSTEM@", "You are Kimi, an AI assistant created by Moonshot AI.")
                  + """\
{%- set ns = namespace(last_answer=-1) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}{%- set ns.last_answer = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
""" + _ROLE + _THINK + _BODY + "{%- endfor -%}\n")
THINKING_TEMPLATE = _THINKING_BODY + _GENERATION_PROMPT
K25_TEMPLATE = _THINKING_BODY + """\
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and not thinking -%}
<think></think>
  {%- else -%}
<think>
  {%- endif -%}
{%- endif -%}
"""
# flavor -> (extra named specials, template, whether the template is its own file)
FLAVORS = {"k2": ({}, CHAT_TEMPLATE, False), "thinking": (THINK_OFFSETS, THINKING_TEMPLATE, True),
           "k2.5": (THINK_OFFSETS, K25_TEMPLATE, True)}

# Training text: varied enough that multi-byte UTF-8 (accents, Han, emoji) gets merged into tokens.
CORPUS = """\
You are a helpful assistant. The user asks a question and the assistant answers it clearly.
system user assistant system user assistant
The quick brown fox jumps over the lazy dog. A small model still has to learn where words begin and end.
When the morning train left the station, the city was quiet; only a few people were walking along the
river, carrying coffee and newspapers. Somebody said that the weather would change by the afternoon,
but nobody believed it. The sky stayed blue, the wind stayed calm, and the clocks kept their slow pace.
It's a long way from here, isn't it? I'm sure we'll find it. They've already gone; you'd better hurry.
She'd read the letter twice before she understood what it meant. He'll tell you the story if you ask.
Questions are good. Answers are better when they are short, honest and correct. Thank you very much!
Mixture-of-experts models route every token to a few experts out of many; the router picks the top
eight by score, and a shared expert sees every token. Attention compresses keys and values into a
latent vector, which keeps the cache small even for long contexts of more than one hundred thousand tokens.
Compilers, engines, graphs, layers, weights, tensors, shapes, inputs, outputs, batches, sequences.
In 1969, 384 people watched 12 screens; by 2024 the number was 3,141,592 and growing by 7.5% each year.
Call 555-0123 or write to room 42 before 10:30 on 2025-07-11. Pi is about 3.14159265358979.
Le petit déjeuner était prêt à sept heures. Où êtes-vous allés cet été ? Nous avons visité Genève,
Besançon et Orléans ; la forêt était très calme, les élèves étudiaient le français et la théorie.
C'est déjà l'hiver : il fait froid, mais le café est chaud et la crème brûlée est délicieuse. Garçon, l'addition !
Ça va très bien, merci. Les hôpitaux, les écoles et les bibliothèques ouvrent à neuf heures précises.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Die Straße war nass, und die Bäume wehten im Wind.
Schöne Grüße aus München! Wir fahren morgen früh nach Köln und Düsseldorf, weil das Wetter besser wird.
Fünf große Äpfel, drei süße Birnen und ein Stück Käse. Öffnungszeiten: Montag bis Freitag, täglich.
Die Mädchen spielten im Garten, während ihre Großmutter Kuchen backte und über alte Zeiten erzählte.
El niño comió una manzana y la señora leyó el periódico en la estación. ¿Dónde está la biblioteca?
我们今天去公园散步，天气很好。人工智能正在改变世界，模型越来越大，计算也越来越快。
你好，世界！我是一个有用的助手。请问你需要什么帮助？中文和English可以混在一起写。
今天是星期五，明天我们去北京看朋友。学习语言需要时间和耐心，每天练习一点点。
大家好，欢迎使用这个小模型。它只有很少的参数，但是结构和大模型一样。
東京は日本の首都です。こんにちは、元気ですか？ありがとうございます。
Emoji time: 😀 😃 😄 😁 🚀 🎉 ❤️ 👍 🔥 ✨ 🌍 🍕 🐍 🤖 👋🏽 and flags 🇩🇪 🇫🇷 🇨🇳. Great job! 🎉🎉
Math: α + β = γ, ∑ x² ≤ ∞, √2 ≈ 1.414, 90° angle, €100 or £80 or ¥500, → ← ↑ ↓, • bullet — dash … ellipsis.
def encode(text: str, allow_special: bool = False) -> list[int]:
    ids = []
    for i, piece in enumerate(split(text)):
        if piece in cache:
            ids.extend(cache[piece])
        else:
            ids.append(rank.get(piece, -1))
    return ids

class Config:
    def __init__(self, hidden_size=128, num_layers=4):
        self.hidden_size = hidden_size
        self.num_layers = num_layers  # TODO: validate

for (int i = 0; i < n; ++i) { sum += x[i] * w[i]; }
if (ptr == NULL) return -1;
const result = await fetch("https://example.com/api/v1/items?id=42&limit=10");
SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY count DESC;
{"key": "value", "numbers": [1, 2, 3], "nested": {"ok": true, "none": null}}
$ pip install -e ".[dev]" && pytest -q tests/ --maxfail=1
    indented line with four spaces
\tline with a tab\tand another tab
Line one.

Line three after a blank line.   Trailing spaces here.   
The end of the corpus: thank you for reading, and have a good day.
Reading, writing, thinking, learning, computing, running, testing, building, shipping, waiting.
Once upon a time there was a little robot who wanted to understand language. Every day it read
books, letters and signs, counting which pairs of letters appeared together most often. Slowly, the
robot learned that "th" and "he" and "in" were very common, and that some words, like "the" and "and",
appeared in almost every sentence. It wrote these discoveries into a notebook, one line at a time.
Gardening advice: plant tomatoes after the last frost, water them deeply twice a week, and pinch off
the suckers so the fruit ripens sooner. Basil, parsley, rosemary and thyme grow happily beside them.
Recipe for pancakes: mix flour, milk, eggs, sugar and a pinch of salt; rest the batter for ten minutes;
fry thin circles in butter until golden; serve with lemon, honey, jam or fresh strawberries.
History remembers explorers, inventors, painters and musicians, yet ordinary farmers, bakers, weavers
and teachers shaped daily life far more. Their names are mostly forgotten, but their work remains.
Physics describes motion, energy, momentum, gravity and light; chemistry studies atoms, molecules and
reactions; biology explains cells, genes, evolution and ecosystems; geology reads mountains and oceans.
Please summarize the following paragraph in two sentences. Can you translate this into German? Why
does the program crash? What is the capital of Australia? How many kilometers are there in a mile?
Sure! Here is a short summary. Certainly, here's the translation. The program crashes because the
index is out of range. Canberra is the capital. One mile is approximately 1.609 kilometers.
Das Frühstück war reichhaltig: Brötchen, Butter, Marmelade, gekochte Eier und ein großer Becher Tee.
Nachdem es aufgehört hatte zu regnen, gingen wir spazieren und beobachteten die Vögel am Seeufer.
Les montagnes étaient couvertes de neige, et les randonneurs marchaient lentement vers le refuge où
un repas chaud les attendait. Après le dîner, ils ont joué aux cartes près de la cheminée.
春天来了，花儿都开了。小朋友们在草地上跑来跑去，老人们坐在树下聊天。
这个程序可以把文字变成数字，再把数字变回文字。分词器是语言模型的第一步。
Status codes: 200 OK, 301 Moved, 404 Not Found, 500 Internal Server Error; ports 8080, 443 and 22.
Temperatures ranged from -12.5 to +38.7 degrees; the average of 17, 23, 29 and 31 is exactly 25.
x = [i ** 2 for i in range(100) if i % 3 == 0]; print(f"{len(x)} squares, max={max(x)}")
while not done: step += 1; loss = model(batch).mean(); loss.backward(); optimizer.step()
import numpy as np; a = np.zeros((4, 8), dtype=np.float32); b = a @ a.T; assert b.shape == (4, 4)
git commit -m "Fix off-by-one error in the scheduler" && git push origin main
"""

# Training pre-split (Python re, an approximation of Kimi's pattern): Han runs, letter runs with an
# optional leading space or symbol and a contraction, digit groups, symbol runs, whitespace.
_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_TRAIN_SPLIT = re.compile(
    rf"[{_HAN}]+"
    rf"|[^\r\n\w]?[^\W\d_{_HAN}]+(?:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\d{1,3}"
    r"| ?[^\s\w]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


def train_bpe(text: str, num_tokens: int) -> list[bytes]:
    """Byte-level BPE: returns the token bytes in rank order (the 256 bytes, then merges in order)."""
    vocab = [bytes([b]) for b in range(256)]
    if num_tokens < 256:
        raise K2Error(f"a byte-level tokenizer needs at least 256 base tokens, not {num_tokens}")
    counts = Counter(_TRAIN_SPLIT.findall(text))
    words = [list(w.encode("utf-8")) for w in counts]
    freqs = list(counts.values())
    by_bytes = {tok: i for i, tok in enumerate(vocab)}

    pair_counts: Counter = Counter()
    pair_words: dict[tuple[int, int], set[int]] = {}
    for wi, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[wi]
            pair_words.setdefault(pair, set()).add(wi)
    # Max-heap by count, ties broken by the smaller pair of ids; stale entries are skipped when popped.
    heap = [(-c, pair) for pair, c in pair_counts.items()]
    heapq.heapify(heap)

    while len(vocab) < num_tokens:
        while heap:
            neg, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) == -neg:
                break
        else:
            raise K2Error(f"the built-in corpus supports only {len(vocab)} base tokens, not {num_tokens}")
        merged = vocab[pair[0]] + vocab[pair[1]]
        # Two different merges can spell the same bytes; reuse the id so every rank is unique.
        new_id = by_bytes.get(merged)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            by_bytes[merged] = new_id
        touched: set[tuple[int, int]] = set()
        for wi in sorted(pair_words.pop(pair)):
            word, freq = words[wi], freqs[wi]
            old_pairs = list(zip(word, word[1:]))
            if pair not in old_pairs:
                continue
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            words[wi] = out
            for p in old_pairs:
                pair_counts[p] -= freq
                touched.add(p)
            for p in zip(out, out[1:]):
                pair_counts[p] += freq
                pair_words.setdefault(p, set()).add(wi)
                touched.add(p)
        for p in sorted(touched):
            c = pair_counts[p]
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                del pair_counts[p]
    return vocab


def _added_token(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def _json(obj: dict) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def write_tiny_tokenizer(out_dir: Path, num_base_tokens: int, *, model_max_length: int = 131072,
                         flavor: str = "k2") -> None:
    """The tokenizer files of a release's flavor (FLAVORS): K2's, or a thinking release's (<think> tokens, the
    thinking template in chat_template.jinja); with tokenization_kimi.py for transformers."""
    out_dir = Path(out_dir)
    extra, template, template_file = FLAVORS[flavor]
    vocab = train_bpe(CORPUS, num_base_tokens)
    ranks_text = "".join(f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(vocab))

    names = {num_base_tokens + off: name for off, name in {**SPECIAL_OFFSETS, **extra}.items()}
    decoder = {str(i): _added_token(names.get(i, reserved_name(i)))
               for i in range(num_base_tokens, num_base_tokens + NUM_RESERVED_SPECIAL)}
    named = [name for name in names.values() if name not in ("[BOS]", "[EOS]", "[PAD]", "[UNK]")]
    config = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": named,
        "auto_map": {"AutoTokenizer": [f"{Path(CODE_FILE).stem}.{CODE_CLASS}", None]},
        "bos_token": "[BOS]",
        **({} if template_file else {"chat_template": template}),
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": model_max_length,
        "pad_token": "[PAD]",
        "tokenizer_class": CODE_CLASS,
        "unk_token": "[UNK]",
    }
    special_map = {
        "additional_special_tokens": named,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
    }
    atomic_write_text(out_dir / RANKS_FILE, ranks_text)
    atomic_write_text(out_dir / CONFIG_FILE, _json(config))
    atomic_write_text(out_dir / "special_tokens_map.json", _json(special_map))
    atomic_write_text(out_dir / CODE_FILE, (Path(__file__).parent / CODE_FILE).read_text(encoding="utf-8"))
    if template_file:
        atomic_write_text(out_dir / TEMPLATE_FILE, template)
