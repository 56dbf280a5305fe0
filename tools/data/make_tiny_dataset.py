#!/usr/bin/env python3
"""Generate the bundled tiny datasets in examples/tiny/data.

chat.jsonl: short conversations a tiny model can learn patterns from (arithmetic, word reversal,
capitals, sorting) in English, German, French, Spanish and Chinese, covering every feature of the
glm5.3 chat template path: system prompts, multi-turn chats, reasoning (as a field and inline in
the content), tool calls with object and JSON-string arguments, parallel tool calls with results
by id, and per-line reasoning effort.
text.jsonl: plain sentences of the same facts for continued pretraining.

The output is a pure function of --seed (default 0): running it again gives identical files.

Usage: python tools/data/make_tiny_dataset.py [--seed N] [--out-dir DIR] [--chat N] [--text N]
"""

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CAPITALS = [
    # country in en, de, fr (with its preposition), es, zh; capital in en, de, fr, es, zh
    (("France", "Frankreich", "de la France", "Francia", "法国"), ("Paris", "Paris", "Paris", "París", "巴黎")),
    (("Germany", "Deutschland", "de l'Allemagne", "Alemania", "德国"), ("Berlin", "Berlin", "Berlin", "Berlín", "柏林")),
    (("Japan", "Japan", "du Japon", "Japón", "日本"), ("Tokyo", "Tokio", "Tokyo", "Tokio", "东京")),
    (("Italy", "Italien", "de l'Italie", "Italia", "意大利"), ("Rome", "Rom", "Rome", "Roma", "罗马")),
    (("Spain", "Spanien", "de l'Espagne", "España", "西班牙"), ("Madrid", "Madrid", "Madrid", "Madrid", "马德里")),
    (("Egypt", "Ägypten", "de l'Égypte", "Egipto", "埃及"), ("Cairo", "Kairo", "Le Caire", "El Cairo", "开罗")),
    (("Peru", "Peru", "du Pérou", "Perú", "秘鲁"), ("Lima", "Lima", "Lima", "Lima", "利马")),
    (("Canada", "Kanada", "du Canada", "Canadá", "加拿大"), ("Ottawa", "Ottawa", "Ottawa", "Ottawa", "渥太华")),
    (("Kenya", "Kenia", "du Kenya", "Kenia", "肯尼亚"), ("Nairobi", "Nairobi", "Nairobi", "Nairobi", "内罗毕")),
    (("Norway", "Norwegen", "de la Norvège", "Noruega", "挪威"), ("Oslo", "Oslo", "Oslo", "Oslo", "奥斯陆")),
    (("China", "China", "de la Chine", "China", "中国"), ("Beijing", "Peking", "Pékin", "Pekín", "北京")),
    (("Brazil", "Brasilien", "du Brésil", "Brasil", "巴西"), ("Brasília", "Brasília", "Brasília", "Brasilia", "巴西利亚")),
]
LANGS = ["en", "de", "fr", "es", "zh"]
CAPITAL_Q = {
    "en": "What is the capital of {c}?",
    "de": "Was ist die Hauptstadt von {c}?",
    "fr": "Quelle est la capitale {c} ?",
    "es": "¿Cuál es la capital de {c}?",
    "zh": "{c}的首都是哪里？",
}
CAPITAL_A = {
    "en": "The capital of {c} is {k}.",
    "de": "Die Hauptstadt von {c} ist {k}.",
    "fr": "La capitale {c} est {k}.",
    "es": "La capital de {c} es {k}.",
    "zh": "{c}的首都是{k}。",
}
WORDS = ["apple", "stone", "river", "glass", "tiger", "music", "cloud", "bread", "Haus", "Straße",
         "fleur", "maison", "perro", "luna", "lamp", "garden", "pixel", "orbit", "candle", "zebra"]
REVERSE_Q = {
    "en": "Reverse the word '{w}'.",
    "de": "Schreibe das Wort '{w}' rückwärts.",
    "fr": "Écris le mot '{w}' à l'envers.",
    "es": "Escribe la palabra '{w}' al revés.",
    "zh": "把单词'{w}'倒过来写。",
}
ARITH_Q = {
    "en": "What is {a} {op} {b}?",
    "de": "Was ist {a} {op} {b}?",
    "fr": "Combien font {a} {op} {b} ?",
    "es": "¿Cuánto es {a} {op} {b}?",
    "zh": "{a} {op} {b} 等于多少？",
}
SYSTEMS = [
    "You are a concise assistant. Answer with as few words as possible.",
    "Du bist ein hilfreicher Assistent.",
    "Tu es un assistant précis.",
    "Eres un asistente breve.",
    "你是一个简洁的助手。",
]
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with +, - and *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. \"12 * 7\""}},
            "required": ["expression"],
        },
    },
}
CAPITAL_TOOL = {
    "type": "function",
    "function": {
        "name": "get_capital",
        "description": "Look up the capital city of a country.",
        "parameters": {
            "type": "object",
            "properties": {"country": {"type": "string"}},
            "required": ["country"],
        },
    },
}


def arith(rng):
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
    else:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return a, op, b, value


def arith_reasoning(a, op, b, value):
    if op == "+":
        return f"{a} + {b}: add the tens, then the ones. {a} + {b} = {value}."
    if op == "-":
        return f"{a} - {b}: subtract {b} from {a}. The result is {value}."
    return f"{a} * {b} is {a} added {b} times, which is {value}."


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def conv_arith(rng, i):
    lang = rng.choice(LANGS)
    a, op, b, value = arith(rng)
    msgs = [user(ARITH_Q[lang].format(a=a, op=op, b=b))]
    style = i % 3
    if style == 0:
        msgs.append(assistant(str(value)))
    elif style == 1:
        msgs.append(assistant(str(value), reasoning_content=arith_reasoning(a, op, b, value)))
    else:
        # Reasoning inline in the content, as some exported chats store it.
        msgs.append(assistant(f"<think>{arith_reasoning(a, op, b, value)}</think>{value}"))
    return {"messages": msgs}


def conv_reverse(rng, i):
    lang = rng.choice(LANGS)
    w = rng.choice(WORDS)
    msgs = []
    if i % 4 == 0:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    msgs.append(user(REVERSE_Q[lang].format(w=w)))
    extra = {}
    if i % 2:
        extra["reasoning_content"] = " ".join(reversed(list(w)))
    msgs.append(assistant(w[::-1], **extra))
    return {"messages": msgs}


def conv_capital(rng, i):
    li = rng.randrange(len(LANGS))
    lang = LANGS[li]
    countries, capitals = rng.choice(CAPITALS)
    msgs = [user(CAPITAL_Q[lang].format(c=countries[li]))]
    answer = CAPITAL_A[lang].format(c=countries[li], k=capitals[li])
    if i % 3 == 0:
        msgs.append(assistant(answer, reasoning_content=f"{countries[0]} -> {capitals[0]}."))
    else:
        msgs.append(assistant(answer))
    return {"messages": msgs}


def conv_sort(rng, i):
    nums = rng.sample(range(1, 50), rng.randint(3, 6))
    msgs = [user("Sort ascending: " + " ".join(map(str, nums))),
            assistant(" ".join(map(str, sorted(nums))))]
    return {"messages": msgs}


def conv_multi_turn(rng, i):
    msgs = [{"role": "system", "content": SYSTEMS[0]}] if i % 2 else []
    for _ in range(rng.randint(2, 3)):
        a, op, b, value = arith(rng)
        msgs.append(user(ARITH_Q["en"].format(a=a, op=op, b=b)))
        extra = {"reasoning_content": arith_reasoning(a, op, b, value)} if rng.random() < 0.5 else {}
        msgs.append(assistant(str(value), **extra))
    w = rng.choice(WORDS)
    msgs.append(user(REVERSE_Q["en"].format(w=w)))
    msgs.append(assistant(w[::-1]))
    out = {"messages": msgs}
    if i % 3 == 0:
        out["reasoning_effort"] = "low"
    return out


def conv_calc_tool(rng, i):
    a, op, b, value = arith(rng)
    expr = f"{a} {op} {b}"
    args = {"expression": expr}
    # Half the calls use the OpenAI wire format: arguments as a JSON string.
    arguments = json.dumps(args) if i % 2 else args
    call_id = f"call_{i}"
    msgs = [
        user(f"Use the calculator: {expr}"),
        assistant("", reasoning_content="I will call the calculator.",
                  tool_calls=[{"id": call_id, "type": "function",
                               "function": {"name": "calculator", "arguments": arguments}}]),
        {"role": "tool", "tool_call_id": call_id, "content": str(value)},
        assistant(f"{expr} = {value}."),
    ]
    return {"messages": msgs, "tools": [CALC_TOOL]}


def conv_capital_tools(rng, i):
    picks = rng.sample(CAPITALS, 2)
    calls, results = [], []
    for j, (countries, capitals) in enumerate(picks):
        call_id = f"cap_{i}_{j}"
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": "get_capital", "arguments": {"country": countries[0]}}})
        results.append({"role": "tool", "tool_call_id": call_id, "content": capitals[0]})
    if i % 2:
        results.reverse()  # results arrive out of order; the template re-orders them by id
    msgs = [
        user(f"What are the capitals of {picks[0][0][0]} and {picks[1][0][0]}?"),
        assistant("Let me look both up.", tool_calls=calls),
        *results,
        assistant(f"{picks[0][1][0]} and {picks[1][1][0]}."),
    ]
    return {"messages": msgs, "tools": [CAPITAL_TOOL, CALC_TOOL]}


KINDS = [conv_arith, conv_reverse, conv_capital, conv_sort, conv_multi_turn, conv_calc_tool,
         conv_capital_tools, conv_arith, conv_reverse, conv_capital]


def text_line(rng, i):
    kind = i % 4
    if kind == 0:
        li = rng.randrange(len(LANGS))
        countries, capitals = rng.choice(CAPITALS)
        return CAPITAL_A[LANGS[li]].format(c=countries[li], k=capitals[li])
    if kind == 1:
        a, op, b, value = arith(rng)
        return f"{a} {op} {b} = {value}."
    if kind == 2:
        w = rng.choice(WORDS)
        return f"The word '{w}' reversed is '{w[::-1]}'."
    nums = rng.sample(range(1, 50), 4)
    return f"Sorted, {' '.join(map(str, nums))} becomes {' '.join(map(str, sorted(nums)))}."


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=REPO / "examples" / "tiny" / "data")
    parser.add_argument("--chat", type=int, default=200, help="number of conversations")
    parser.add_argument("--text", type=int, default=100, help="number of text lines")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.out_dir / "chat.jsonl", "w", encoding="utf-8") as f:
        for i in range(args.chat):
            f.write(json.dumps(KINDS[i % len(KINDS)](rng, i), ensure_ascii=False) + "\n")
    with open(args.out_dir / "text.jsonl", "w", encoding="utf-8") as f:
        for i in range(args.text):
            f.write(json.dumps({"text": text_line(rng, i)}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
