"""The built-in chat formats: the tool-rendering Qwen3 template of tiny_qwen3_tools."""

import hashlib

import torch

from dflash.target.tokenizer import CHAT_TEMPLATE

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}]


def test_the_tools_template_renders_tools_calls_and_results_in_qwen3s_format(tools_target):
    """Tools listed in a system turn (after the conversation's own system text) as JSON lines within <tools></tools>;
    an assistant turn's calls after its content as <tool_call> blocks (arguments given as a dict or as a JSON
    string); a run of tool results one user turn of <tool_response> blocks."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris and Lyon?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Lyon"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "20C"}, {"role": "tool", "content": "18C"}]
    text = tools_target.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                      add_generation_prompt=True, enable_thinking=False)
    head, rest = text.split("<|im_end|>\n", 1)
    assert head.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and "<tools>\n{\"type\": \"function\", " \
        "\"function\": {\"name\": \"get_weather\"" in head and head.endswith("\n</tool_call>")
    assert rest == ("<|im_start|>user\nParis and Lyon?<|im_end|>\n"
                    "<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                    "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                    "{\"city\": \"Lyon\"}}\n</tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n20C\n</tool_response>\n<tool_response>\n18C\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # without tools or tool turns it renders what tiny_qwen3's template does
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
             {"role": "user", "content": "x"}]
    assert tools_target.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_tiny_qwen3_tools_is_tiny_qwen3_with_another_template(tools_target, tiny_targets):
    """The same model and vocabulary (mask token 261); tiny_qwen3's own template is unchanged (its string is in the
    tokenizer fingerprint of the shipped toy target and of every cache keyed by it)."""
    plain = tiny_targets["tiny_qwen3"]
    assert tools_target.mask_token_id == plain.mask_token_id == 261
    assert len(tools_target.tokenizer) == len(plain.tokenizer)
    ids = torch.tensor([[1, 2, 3, 260, 7]])
    with torch.no_grad():
        assert torch.equal(tools_target.model(ids).logits, plain.model(ids).logits)
    assert plain.tokenizer.chat_template == CHAT_TEMPLATE != tools_target.tokenizer.chat_template
    assert hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:12] == "b91b482f1385"
