"""What a chat request asks of its answer's shape, resolved once per request: the template's arguments (the tools,
chat_template_kwargs), the grammar a forced answer is decoded under (tool_choice "required" or a named function,
response_format json_object / json_schema), and how the answer's text is split (thinking, K2-format tool calls).
"""

from __future__ import annotations

from dataclasses import dataclass

from k2trt.runtime.serve import protocol
from k2trt.runtime.text.chat_output import ChatOutputParser, answer_parser, template_thinks
from k2trt.runtime.text.grammar import Grammar, GrammarError, Grammars, json_grammar, schema_text, tool_call_grammar

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class AnswerShape:
    template_kwargs: dict  # what the chat template gets besides the messages
    reasoning: bool  # the template thinks: the answer opens with reasoning_content
    tool_names: frozenset[str] | None  # the functions the answer may call; None: tool calls are not parsed
    grammar: Grammar | None = None
    max_calls: int | None = None  # parallel_tool_calls false: 1

    def parser(self) -> ChatOutputParser | None:
        """A fresh splitter for one choice's text (streamed, or whole through chat_output.split_answer), or None
        where the text is all content."""
        return answer_parser(self.reasoning, self.tool_names, self.max_calls)


def answer_shape(body: protocol.ChatCompletionRequest, tokenizer, grammars: Grammars) -> AnswerShape:
    """Every part checked (a schema the grammar library refuses, or too large, is a 400 naming its field)."""
    kwargs = dict(body.chat_template_kwargs or {})
    reasoning = template_thinks(tokenizer, kwargs)
    if body.tools:
        kwargs["tools"] = [t.for_template() for t in body.tools]
    tool_names = frozenset(body.tool_names()) if body.tools_active() else None
    source, field = None, None
    try:
        if forced := body.forced_tools():
            field = "tools"
            functions = [(t.function.name, schema_text(t.function.parameters or NO_ARGUMENTS, bool(t.function.strict),
                                                       f"tools: function {t.function.name!r} parameters"))
                         for t in forced]
            # a named function is called once; "required" calls one or more when parallel calls are allowed
            source = tool_call_grammar(functions, parallel=body.parallel_tool_calls and body.tool_choice == "required",
                                       reasoning=reasoning)
        elif body.response_format is not None and body.response_format.type != "text":
            field, fmt = "response_format", body.response_format
            schema, strict = ({"type": "object"}, False) if fmt.type == "json_object" else \
                (fmt.json_schema.json_schema, bool(fmt.json_schema.strict))
            source = json_grammar(schema_text(schema, strict, "response_format json_schema"), reasoning=reasoning)
    except GrammarError as e:
        raise protocol.APIError(400, str(e), param=field) from None
    try:
        grammar = grammars.compile(source) if source is not None else None
    except GrammarError as e:
        raise protocol.APIError(400, f"{field}: the grammar library refuses the schema: {e}", param=field) from None
    return AnswerShape(kwargs, reasoning, tool_names, grammar, None if body.parallel_tool_calls else 1)
