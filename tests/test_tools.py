"""Tool calling (tools.py): the stream parser gives the whole parse whatever the text's pieces; the
grammar admits exactly well-formed calls of the named tools (and, under auto, free text); the law
of a tool grammar's output holds through drafting (chi-square, with a biased variant the same test
rejects); and the server, driven by the `openai` client on the real default model (fp32), answers
every tool_choice streamed and whole alike, identically for plain decoding and every drafter, with
calls that parse and validate, and refuses bad tool requests naming the field."""

import json
import random
from types import SimpleNamespace

import pytest
import torch
from openai import OpenAI
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from dspark import tools
from dspark.drafters import DraftLMDrafter, load_drafter
from dspark.engine import Engine
from dspark.sampling import SamplingParams
from dspark.server import create_app, in_thread
from dspark.structured import GrammarSpec, grammar_state

from _lossless import CyclingPolicy, chi2_pvalue, constrained_law
from _tiny import tiny_target

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": [1, {"a": "}\\n<"}]}}\n</tool_call>'


# ----------------------------------------------------------------------------------- the parser
@pytest.mark.parametrize("text", [
    "Just text, with a <table> and a < sign.",
    "Let me look. " + CALL,
    CALL + "\n" + CALL.replace("get_weather", "add"),
    CALL + "\n",                        # the newline that may close the calls
    CALL[:-5],                          # cut off inside the closing tag
    CALL[:40],                          # cut off inside the arguments
    CALL[:25],                          # cut off inside the name
    "Hello <tool_c",                    # cut off inside the opening tag
])
def test_the_stream_of_any_split_reassembles_to_the_whole_parse(text):
    content, calls = tools.parse(text)
    for seed in range(300):
        rng = random.Random(seed)
        s, got, args, names, ids = tools.ToolCallStream(), "", {}, {}, {}
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(1, 14)
            pieces.append(text[i:i + k])
            i += k
        outs = [s.add(p) for p in pieces] + [s.finish()]
        for c, deltas in outs:
            got += c
            for d in deltas:
                if "id" in d:
                    assert d["index"] not in ids and d["function"]["arguments"] == ""
                    ids[d["index"]], names[d["index"]] = d["id"], d["function"]["name"]
                assert d["index"] in ids       # a call's id and name come before its arguments
                args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
        assert got == content
        assert [names[k] for k in sorted(names)] == [c.name for c in calls]
        assert [args.get(k, "") for k in sorted(names)] == [c.arguments for c in calls]


def test_whole_calls_parse_to_their_json_and_partial_tags_are_held_back():
    content, calls = tools.parse("Sure. " + CALL)
    assert content == "Sure. " and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "x": [1, {"a": "}\n<"}]}
    s = tools.ToolCallStream()
    assert s.add("Hello <tool_")[0] == "Hello "           # could be a call's start: held back
    assert s.add("call>\n{\"na") == ("", [])
    c, deltas = s.add('me": "add", "arguments": {"a": 1, "b": 2}}\n</tool_')
    assert c == "" and deltas[0]["function"]["name"] == "add"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"a": 1, "b": 2}'
    assert s.add("call>") == ("", []) and s.finish() == ("", [])


# ---------------------------------------------------------------------------------- the grammar
def _accepts(target, grammar_text, text):
    from llguidance import LLMatcher
    from dspark.structured import grammar_tokenizer
    m = LLMatcher(grammar_tokenizer(target), grammar_text, log_level=0)
    ok = m.consume_tokens(target.tokenizer(text, add_special_tokens=False)["input_ids"])
    return bool(ok) and not m.is_error() and m.is_accepting()


def test_the_grammar_admits_well_formed_calls_of_the_named_tools_only(target_fp32):
    fs = [tools.Function("get_weather", "", WEATHER), tools.Function("add", "", ADD)]
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
    two = good + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    cases = {
        "Plain text with <b>tags</b>, a < sign and <t or <tool>.": ("auto",),
        "I will check. " + good: ("auto",),
        good: ("auto", "required", "get_weather"),
        two: ("auto", "required"),
        two + "\n": ("auto", "required"),
        good + "\n\n": (),
        '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Lyon"}}\n</tool_call>': (),  # not its schema
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>': (),                       # not a tool
        "Oops <tool_call> not a call": (),
        good + " and text after": (),
    }
    grammars = {mode: GrammarSpec("grammar", tools.grammar(fs, mode)).compile()
                for mode in ("auto", "required", "get_weather")}
    for text, modes in cases.items():
        for mode, g in grammars.items():
            assert _accepts(target_fp32, g, text) == (mode in modes), (mode, text)
    single = GrammarSpec("grammar", tools.grammar(fs, "required", parallel=False)).compile()
    assert _accepts(target_fp32, single, good) and not _accepts(target_fp32, single, two)


def test_tags_that_are_added_tokens_are_named_by_id_in_the_grammar(target_fp32):
    import copy
    tok = copy.deepcopy(target_fp32.tokenizer)
    assert tools.tag_tokens(tok) == (None, None)            # SmolLM2: the tags are text
    tok.add_tokens([tools.OPEN, tools.CLOSE])
    tags = tools.tag_tokens(tok)
    assert tags == tuple(tok.convert_tokens_to_ids([tools.OPEN, tools.CLOSE]))
    text = tools.grammar([tools.Function("f", "", ADD)], "required", True, tags)
    assert f"<[{tags[0]}]> " in text and f" <[{tags[1]}]>" in text and tools.OPEN not in text


QWEN_LIKE = ("{%- if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
             "Call with <tool_call></tool_call>.<|im_end|>\n{%- endif %}"
             "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
             "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
             "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endfor %}"
             "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_rendering_by_the_template_that_knows_tools_or_in_the_system_turn(target_fp32):
    tok = target_fp32.tokenizer
    assert tools.pick_format(tok) == "generic"
    assert tools.pick_format(SimpleNamespace(chat_template=QWEN_LIKE)) == "hermes"
    history = [{"role": "user", "content": "Weather in Lyon?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Lyon"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    fs = [tools.Function("get_weather", "The weather", WEATHER)]
    msgs, tpl = tools.render_messages(history, fs, "generic")
    assert tpl is None and msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert tools.CLOSE in msgs[2]["content"] and msgs[3] == {"role": "user", "content":
                                                             "<tool_response>\n12 C\n</tool_response>"}
    tok.apply_chat_template(msgs, tokenize=False)        # the bundled template renders it
    msgs, tpl = tools.render_messages(history, fs, "hermes")
    assert tpl[0]["function"]["name"] == "get_weather"
    # the template's tojson writes the arguments once, not a JSON string of JSON
    from jinja2 import Environment
    env = Environment()
    env.filters["tojson"] = lambda v: json.dumps(v)
    text = env.from_string(QWEN_LIKE).render(messages=msgs, tools=tpl, add_generation_prompt=True)
    assert '"arguments": {"city": "Lyon"}}' in text


# ------------------------------------------------------------------------ the law, through drafting
# no piece of a tag alone: a token that starts a tag the pieces cannot finish would be a dead end
PIECES = [tools.HEAD, "f", "g", tools.MID, '{"k": ', "1", "2", "{", "}", tools.TAIL, "\n", "</s>"]
EOS = len(PIECES) - 1


def _piece_target(decoder):
    """A target whose tokens are whole pieces of the call syntax (so a short output holds a call); its
    byte-level tokenizer splits text into those pieces (llguidance tokenizes what a grammar forces)."""
    import re
    from tokenizers import Regex, pre_tokenizers
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    spelt = [byte_level.pre_tokenize_str(p)[0][0] for p in PIECES]       # each piece in byte-level letters
    tk = Tokenizer(models.WordLevel({p: i for i, p in enumerate(spelt)}, unk_token=spelt[EOS]))
    alternation = "|".join(re.escape(p) for p in sorted(PIECES, key=len, reverse=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(alternation), "isolated"), byte_level])
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=spelt[EOS])
    return SimpleNamespace(model=decoder, tokenizer=tok, eos_token_ids=(EOS,))


def _law(target, grammar, prompt, n_new, bias=None):
    return constrained_law(target, grammar, prompt, n_new, SamplingParams(temperature=1.0), len(PIECES), EOS, bias)


def test_a_tool_grammars_output_follows_the_masked_law_through_drafting():
    V = len(PIECES)
    target = _piece_target(tiny_target(0, scale=4.0, vocab=V))
    fs = [tools.Function("f", "", {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"],
                                   "additionalProperties": False}),
          tools.Function("g", "", {"type": "object", "properties": {}, "additionalProperties": False})]
    grammar = GrammarSpec("grammar", tools.grammar(fs, "required")).compile()
    prompt, n_new, draws = [10, 1, 10], 9, 800
    policy = CyclingPolicy()
    engine = Engine(target.model, DraftLMDrafter(tiny_target(1, scale=4.0, vocab=V), block_size=3), policy,
                    max_requests=32, max_len=24, eos_ids=(EOS,))
    reqs = [engine.add_request(prompt, SamplingParams(temperature=1.0, seed=s), n_new, exact_seed=False,
                               grammar=grammar_state(target, grammar)) for s in range(draws)]
    engine.run()
    assert {1, 2, 3} <= policy.used
    # the grammar forces most tokens (jump-forward); the drafter's are verified at the choices
    assert sum(r.stats.num_accepted_tokens for r in reqs) > 20 and sum(r.stats.num_forced_tokens for r in reqs) > 1000
    counts: dict = {}
    for r in reqs:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    names = [c.name for k in counts for c in tools.parse(target.tokenizer.decode(list(k)))[1]]
    assert {"f", "g"} <= set(names), "both functions should be called"
    assert chi2_pvalue(counts, _law(target, grammar, prompt, n_new)) > 1e-3
    # the same test tells a law apart that favours one function a little
    bias = torch.zeros(V)
    bias[2] = 0.5
    assert chi2_pvalue(counts, _law(target, grammar, prompt, n_new, bias)) < 1e-3


# ----------------------------------------------------------------------------------- the server
PROMPTS = [[{"role": "user", "content": "What is the weather in Paris right now?"}],
           [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Please add 17 and 25 for me."}]]
CHOICES = ["none", "auto", "required", {"type": "function", "function": {"name": "add"}}]


def _ask(client, messages, choice, stream, parallel=True):
    kw = dict(model="smollm2-135m-instruct", messages=messages, tools=TOOLS, tool_choice=choice, temperature=0,
              max_tokens=32, parallel_tool_calls=parallel)
    if not stream:
        r = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in r.message.tool_calls or []]
        return r.message.content or "", calls, r.finish_reason
    content, names, args, finish = "", {}, {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for c in d.tool_calls or []:
            if c.function.name:
                names[c.index] = c.function.name
            args[c.index] = args.get(c.index, "") + (c.function.arguments or "")
        finish = ch.choices[0].finish_reason or finish
    return content, [(names[k], args.get(k, "")) for k in sorted(names)], finish


def _valid(calls, finish):
    """Every call of a finished answer names a tool and its arguments parse and fit the schema."""
    if finish != "tool_calls":
        return finish == "length"
    schemas = {"get_weather": WEATHER, "add": ADD}
    for name, args in calls:
        value = json.loads(args)
        schema = schemas[name]
        assert set(schema["required"]) <= set(value) <= set(schema["properties"])
        if name == "add":
            assert all(isinstance(value[k], int) for k in "ab")
        elif "unit" in value:
            assert value["unit"] in ("c", "f")
    return bool(calls)


@pytest.mark.parametrize("drafters", [("plain", "ngram", "dspark", "ngram+dspark", "dflash", "cut:8")])
def test_every_tool_choice_streams_as_it_answers_whole_and_drafters_change_nothing(target_fp32, drafters):
    answers: dict = {}
    history: list = []
    for j, name in enumerate(drafters):
        d = load_drafter(name, target_fp32)
        engine = Engine(target_fp32.model, d, max_requests=2, max_len=1024, block_size=d.block_size,
                        eos_ids=target_fp32.eos_token_ids, isolate_failures=True)
        with in_thread(create_app(target_fp32, engine)) as (url, _, _):
            client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            # plain answers every choice for both prompts; each drafter every choice for one of them
            prompts = list(enumerate(PROMPTS)) if name == "plain" else [(j % 2, PROMPTS[j % 2])]
            for i, msgs in prompts:
                for choice in CHOICES:
                    key = (i, json.dumps(choice))
                    whole = _ask(client, msgs, choice, stream=False)
                    assert _ask(client, msgs, choice, stream=True) == whole, (name, key)
                    assert answers.setdefault(key, whole) == whole, (name, key)   # = plain decoding's
                    if choice == "none":
                        assert not whole[1] and whole[2] in ("stop", "length")
                    elif choice != "auto":
                        assert _valid(whole[1], whole[2]), whole
            if name == "plain":
                # a named choice calls that function, once; one call only without parallel calls
                assert [c[0] for c in answers[(1, json.dumps(CHOICES[3]))][1]] == ["add"]
                assert len(_ask(client, PROMPTS[0], "required", False, parallel=False)[1]) == 1
                calls = client.chat.completions.create(
                    model="smollm2-135m-instruct", messages=PROMPTS[0], tools=TOOLS, tool_choice="required",
                    temperature=0, max_tokens=32).choices[0].message.tool_calls
                history = PROMPTS[0] + [{"role": "assistant", "content": None,
                                         "tool_calls": [c.model_dump() for c in calls]},
                                        {"role": "tool", "tool_call_id": calls[0].id, "content": "21 C, sunny"}]
            # a conversation that returns the tool's result goes on from it, alike for every drafter
            after = _ask(client, history, "auto", stream=False)
            assert after == _ask(client, history, "auto", stream=True)
            assert answers.setdefault("after", after) == after, name
            assert after[0] and after[2] in ("stop", "length", "tool_calls")


def _post(url, body):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_tool_requests_get_a_400_naming_the_field(target_fp32):
    engine = Engine(target_fp32.model, None, max_requests=1, max_len=512, eos_ids=target_fp32.eos_token_ids,
                    isolate_failures=True)
    msgs = [{"role": "user", "content": "hi"}]
    fn = {"name": "f", "parameters": {"type": "object"}}
    big = {"name": "big", "description": "x" * 20_000}
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": fn}], "tool_choice": {"type": "function",
                                                                            "function": {"name": "g"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(tools.MAX_TOOLS + 1)]},
         "tools"),
        ({"tools": [{"type": "function", "function": big}]}, "tools"),
        ({"tools": [{"type": "function", "function": fn}] * 2}, "tools"),
        ({"tools": [{"type": "function", "function": fn}], "response_format": {"type": "json_object"}}, "tools"),
        ({"tool_choice": "sometimes", "tools": [{"type": "function", "function": fn}]}, "tool_choice"),
    ]
    with in_thread(create_app(target_fp32, engine)) as (url, _, _):
        for extra, field in cases:
            code, out = _post(url, {"messages": msgs, "max_tokens": 4, **extra})
            assert code == 400 and out["error"]["param"] == field, (extra, out)
        # a tool message needs the call it answers; tools on the completions route are unknown there
        code, out = _post(url, {"messages": msgs + [{"role": "tool", "content": "1"}]})
        assert code == 400 and "tool_call_id" in out["error"]["message"]
        import urllib.request
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"prompt": "hi", "tools": [{"type": "function", "function": fn}]}).encode(),
            headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("tools accepted on /v1/completions")
        except urllib.error.HTTPError as e:
            assert e.code == 400 and "tools" in json.loads(e.read())["error"]["message"]


def test_the_tool_benchmark_names_valid_calls_and_identity_to_plain(capsys):
    from dspark.cli import main
    assert main(["bench", "tools", "--num-prompts", "3", "--modes", "named", "--max-tokens", "96", "--dtype", "fp32",
                 "--drafter", "ngram+dspark", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["identical_to_plain"] == out["answers"] == 3
    for system in ("plain", "ngram+dspark"):
        named = out["results"][system]["named"]
        assert named["valid_calls"] == 1.0 and named["whole_calls"] >= 1 and named["expected_calls"] > 0
