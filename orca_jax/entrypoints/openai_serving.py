"""OpenAI semantics on top of the async engine: turning a validated request into engine
requests, and engine outputs into OpenAI response bodies and server-sent-event chunks.

HTTP concerns (routing, auth, body limits, status codes of transport errors) live in
server.py; this module knows nothing of them except the one callback it is given to learn
that the client went away.

Choice indices follow OpenAI: with several prompts and n samples each, choice `p * n + i` is
sample i of prompt p. A streamed chat sends each choice's role first, then (with vLLM's `echo`)
the echoed last assistant message, then its content, then its finish reason in a chunk of its
own; with `stream_options.include_usage` a last chunk with no choices carries the usage. A
request that fails inside a step ends its stream with an error event (the status line has
long been sent), or answers 500 when not streamed.

String prompts are tokenized here, with this side's own tokenizer, so that the context rule
OpenAI and vLLM apply (prompt + max_tokens <= max_model_len, else a 400) is checked before
anything is queued; the engine receives token ids (in vLLM's TokensPrompt dict, beside the
request's `cache_salt`, when it has one). A request's prompts enter the engine in one inbox
operation, all or none.

The engine is asked for "delta" outputs when streaming (each output holds only its new text,
token ids and log-probs, so a chunk costs what it sends) and for "final_only" outputs
otherwise (one output per prompt, at its finish). Usage counts the new token ids of every
output, which is right in each kind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from orca_jax.engine.async_engine import (AsyncLLMEngine, EngineStoppedError, QueueFullError, RequestFailedError,
                                   RequestStream)
from orca_jax.errors import CONSTRAINT_FAILED, RequestError
from orca_jax.entrypoints.chat_template import apply_chat_template
from orca_jax.entrypoints.reasoning_parsers import ReasoningParser, ReasoningStream, message_fields
from orca_jax.entrypoints.chat_tools import NO_TOOLS, StreamedChoice, ToolPlan, chat_message, finish_reason, plan_tools
from orca_jax.engine.outputs import CompletionOutput, RequestOutput
from orca_jax.entrypoints.protocol import (ChatCompletionRequest, ClientName, CompletionRequest, DetokenizeRequest,
                                           OpenAIError, SamplingRequest, TokenizeRequest,
                                           bad_request, request_error_to_openai)
from orca_jax.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
WaitForDisconnect = Callable[[], Awaitable[None]]
Names = dict[str, ClientName]  # engine argument -> the client's field, per endpoint

# In a chat request the engine's prompt is the templated messages, and its logprobs is
# top_logprobs; errors about them name the chat fields.
_CHAT_NAMES: Names = {
    "prompt": ClientName("messages", "the prompt is the messages after the chat template"),
    "logprobs": ClientName("top_logprobs", "top_logprobs is the number of log-probabilities asked for"),
}


@dataclass
class _Submitted:
    """The engine requests behind one HTTP request, one per prompt."""

    request_id: str
    created: int
    streams: list[RequestStream]
    prompt_texts: list[str]  # per prompt; filled once the engine has accepted the prompts (echo)
    last_outputs: list[RequestOutput | None] = field(default_factory=list)  # per prompt
    completion_tokens: int = 0  # generated so far, over all prompts and samples (usage)

    def abort_all(self) -> None:
        for stream in self.streams:
            stream.abort()


@dataclass
class EventStream:
    """A streamed response: its server-sent events, and `close`, which the HTTP layer calls
    however the response ends (even if the client left before the first event was pulled,
    when the generator's own cleanup never runs)."""

    events: AsyncIterator[str]
    close: Callable[[], None]


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, tokenizer, model_name: str, max_model_len: int,
                 on_reject: Callable[[str], None] | None = None, auto_tool_parser: str | None = None,
                 chat_template: str | None = None, default_chat_template_kwargs: dict | None = None,
                 log_requests: bool = False, max_log_len: int | None = None,
                 reasoning: ReasoningParser | None = None):
        self.engine = engine
        # --reasoning-parser: the reasoning apart from the content, in both response shapes.
        self.reasoning = reasoning
        # --generation-config: the model's sampling values for the fields a request leaves out.
        self.sampling_defaults = dict(getattr(engine.engine, "sampling_defaults", {}))
        # --enable-log-requests: one line per request (id, prompt length, sampling parameters);
        # the prompt's text only with --max-log-len, cut to that many characters.
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        # --chat-template and --default-chat-template-kwargs: a request's own fields win.
        self.chat_template = chat_template
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        # The --tool-call-parser when --enable-auto-tool-choice is on: tool_choice "auto" parses
        # the reply with it (orca_jax.entrypoints.chat_tools).
        self.auto_tool_parser = auto_tool_parser
        # The engine thread uses the engine's own tokenizer; this one belongs to the event loop
        # (templates, echo, logprob token strings), so no tokenizer is shared between threads.
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._on_reject = on_reject or (lambda reason: None)

    # ---- /v1/completions ------------------------------------------------------------------
    async def completions(self, request: CompletionRequest, wait_for_disconnect: WaitForDisconnect,
                          request_id: str | None = None):
        self._check_model(request)
        names: Names = {}
        # An echoed prompt with logprobs reports the prompt tokens' values too (lm-evaluation-
        # harness scores a text this way: max_tokens 1, logprobs 1, echo true).
        echo_logprobs = request.echo and request.logprobs is not None
        needed = max(request.logprobs, request.prompt_logprobs or 0) if echo_logprobs else None
        if echo_logprobs:
            names = {"prompt_logprobs": ClientName("logprobs", "with echo, logprobs also covers the prompt")}
        params = _sampling_params(request, request.max_tokens, request.logprobs, names, request.stream, needed,
                                  self.sampling_defaults)
        params = _constrained(params, request, names)
        prompt_ids = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in request.prompt]
        for ids in prompt_ids:
            self._check_room(self._kept_length(len(ids), params.truncate_prompt_tokens), params.max_tokens, "max_tokens")
        submitted = await self._submit("cmpl", prompt_ids, params, names, request.cache_salt, request_id)
        # Echoed token-id prompts are decoded only now, once the engine has checked their range.
        try:
            submitted.prompt_texts = [p if isinstance(p, str) else self.tokenizer.decode(p) if request.echo else ""
                                      for p in request.prompt]
        except BaseException:
            submitted.abort_all()
            raise
        if request.stream:
            return EventStream(self._completion_chunks(request, submitted, wait_for_disconnect), submitted.abort_all)
        outputs = await _collect(submitted, wait_for_disconnect)
        choices = [
            self._completion_choice(request, p * request.n + c.index, c, submitted.prompt_texts[p], output)
            for p, output in enumerate(outputs) for c in output.outputs
        ]
        return {
            "id": submitted.request_id, "object": "text_completion", "created": submitted.created,
            "model": self.model_name, "choices": choices, "usage": _usage(submitted),
        }

    def _completion_choice(self, request, index, completion: CompletionOutput, prompt_text, output) -> dict:
        text = (prompt_text if request.echo else "") + completion.text
        logprobs = None
        if request.logprobs is not None:
            prompt_ids = output.prompt_token_ids if request.echo else []
            logprobs = self._completion_logprobs(prompt_ids, completion.token_ids, completion.logprobs or [],
                                                 request.logprobs, 0, output.prompt_logprobs)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason}
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs_body(output.prompt_logprobs, request.prompt_logprobs)
        return choice

    async def _completion_chunks(self, request: CompletionRequest, submitted: _Submitted,
                                 wait_for_disconnect: WaitForDisconnect) -> AsyncIterator[str]:
        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": submitted.request_id, "object": "text_completion", "created": submitted.created,
                    "model": self.model_name, "choices": choices}
            if usage is None and request.usage_in_every_chunk:  # vLLM's continuous_usage_stats
                usage = _usage(submitted)
            if usage is not None:
                body["usage"] = usage
            return _sse(body)

        offsets: dict[int, int] = {}  # per choice: characters sent so far (logprobs text_offset)
        finished: set[int] = set()
        async for p, output in _stream_outputs(submitted, wait_for_disconnect):
            if isinstance(output, OpenAIError):
                yield _sse(output.body())
                break
            for c in output.outputs:
                index = p * request.n + c.index
                if index in finished:
                    continue
                first = index not in offsets
                echo = submitted.prompt_texts[p] if request.echo and first else ""
                new_ids = c.delta_token_ids
                logprobs = None
                if request.logprobs is not None:
                    prompt_ids = output.prompt_token_ids if echo else []
                    logprobs = self._completion_logprobs(prompt_ids, new_ids, _delta_logprobs(c), request.logprobs,
                                                         offsets.get(index, 0), output.prompt_logprobs)
                text = echo + c.delta_text
                offsets[index] = offsets.get(index, 0) + len(text)
                if c.finish_reason is not None:
                    finished.add(index)
                if text or new_ids or c.finish_reason is not None or first:
                    body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
                    if first and request.prompt_logprobs is not None:
                        body["prompt_logprobs"] = self._prompt_logprobs_body(output.prompt_logprobs,
                                                                             request.prompt_logprobs)
                    yield chunk([body])
        else:
            if request.include_usage_in_stream:
                yield chunk([], _usage(submitted))
        yield "data: [DONE]\n\n"

    def _completion_logprobs(self, prompt_ids, token_ids, logprobs, k, offset, prompt_logprobs=None) -> dict:
        """The legacy completions shape. Echoed prompt tokens carry the prompt's log-probabilities
        (`prompt_logprobs`), the first token None (nothing precedes it), as OpenAI reports them."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for position, token in enumerate(list(prompt_ids) + list(token_ids)):
            text = self._token_text(token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if position < len(prompt_ids):
                lps = prompt_logprobs[position] if prompt_logprobs else None
                token_lps.append(None if lps is None else lps.get(token))
                tops.append(None if lps is None else {self._token_text(t): lp for t, lp in _top(lps, k)})
                continue
            lps = logprobs[position - len(prompt_ids)]
            token_lps.append(lps.get(token))
            tops.append({self._token_text(t): lp for t, lp in _top(lps, k)})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    # ---- /v1/chat/completions -------------------------------------------------------------
    async def chat(self, request: ChatCompletionRequest, wait_for_disconnect: WaitForDisconnect,
                   request_id: str | None = None):
        self._check_model(request)
        try:
            plan = plan_tools(request, self.auto_tool_parser)
        except RequestError as exc:
            raise request_error_to_openai(exc) from None
        prompt_ids = self._chat_prompt(request, plan)
        names = dict(_CHAT_NAMES)
        if request.max_tokens_field != "max_tokens":
            names["max_tokens"] = ClientName(request.max_tokens_field, f"{request.max_tokens_field} is max_tokens")
        # Without a length the reply may fill the context (OpenAI's and vLLM's rule); a prompt
        # that leaves no room is refused by the engine, so 1 is only a placeholder then.
        max_tokens = request.requested_max_tokens
        if max_tokens is None:
            max_tokens = max(1, self._room(self._kept_length(len(prompt_ids), request.truncate_prompt_tokens)))
        params = _sampling_params(request, max_tokens, request.engine_logprobs, names, request.stream,
                                  defaults=self.sampling_defaults)
        params = _constrained(params, request, names, plan)
        if self.reasoning is not None and self.reasoning.needs_special_tokens:
            # Harmony's channel markers are special tokens; the parser removes every one of them.
            params = dataclasses.replace(params, skip_special_tokens=False)
        prompt_text = self.tokenizer.decode(prompt_ids) if self.reasoning is not None else ""
        if self.reasoning is not None and params.structured_outputs is not None:
            # The answer is constrained, not the reasoning before it.
            starts_after = self.reasoning.constraint_waits_for(prompt_text)
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                params.structured_outputs, starts_after=starts_after))
        self._check_room(self._kept_length(len(prompt_ids), params.truncate_prompt_tokens), params.max_tokens, request.max_tokens_field)
        submitted = await self._submit("chatcmpl", [prompt_ids], params, names, request.cache_salt, request_id)
        submitted.prompt_texts = [""]
        if request.stream:
            return EventStream(self._chat_chunks(request, plan, submitted, wait_for_disconnect, prompt_text),
                               submitted.abort_all)
        (output,) = await _collect(submitted, wait_for_disconnect)
        choices = [{
            "index": c.index,
            **self._chat_message(request, plan, c, prompt_text),
            "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, request) if request.logprobs else None,
        } for c in output.outputs]
        body = {
            "id": submitted.request_id, "object": "chat.completion", "created": submitted.created,
            "model": self.model_name, "choices": choices, "usage": _usage(submitted),
        }
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_body(output.prompt_logprobs, request.prompt_logprobs)
        return body

    def _chat_message(self, request: ChatCompletionRequest, plan: ToolPlan, completion: CompletionOutput,
                      prompt_text: str) -> dict:
        """The choice's message and finish reason: the reasoning apart (with a reasoning parser),
        tool calls parsed out of the content."""
        if self.reasoning is None:
            return chat_message(request.echo_text + completion.text, completion.finish_reason, plan)
        reasoning, content = message_fields(self.reasoning, completion.text, prompt_text)
        choice = chat_message(request.echo_text + content, completion.finish_reason, plan)
        message = choice["message"]
        if reasoning and not message["content"]:
            message["content"] = None  # all reasoning: no answer yet (cut off), as vLLM reports it
        if request.include_reasoning:
            message.update(reasoning)
        return choice

    def _template_kwargs(self, request: ChatCompletionRequest | TokenizeRequest) -> dict:
        """The template's extra variables: the server's defaults, the request's
        chat_template_kwargs over them, and OpenAI's `reasoning_effort` (gpt-oss's template
        reads it) unless those set it already."""
        kwargs = {**self.default_chat_template_kwargs, **(request.chat_template_kwargs or {})}
        if request.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", request.reasoning_effort)
        return kwargs

    def _chat_prompt(self, request: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        conversation = [m.as_template_dict() for m in request.messages]
        kwargs = self._template_kwargs(request)
        try:
            return apply_chat_template(self.tokenizer, conversation, request.add_generation_prompt, tools=plan.tools,
                                       call_format=plan.call_format,
                                       continue_final_message=request.continue_final_message,
                                       chat_template=request.chat_template or self.chat_template,
                                       template_kwargs=kwargs)
        except ValueError as exc:  # no template, or a final message the template does not render
            raise bad_request(str(exc), "continue_final_message" if request.continue_final_message else "messages") \
                from None
        except TypeError as exc:  # a chat_template_kwargs name that clashes with the template's own arguments
            raise bad_request(f"chat_template_kwargs: {exc}", "chat_template_kwargs") from None
        except Exception as exc:  # noqa: BLE001 - the template itself refused the conversation
            raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None

    async def _chat_chunks(self, request: ChatCompletionRequest, plan: ToolPlan, submitted: _Submitted,
                           wait_for_disconnect: WaitForDisconnect, prompt_text: str = "") -> AsyncIterator[str]:
        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": submitted.request_id, "object": "chat.completion.chunk", "created": submitted.created,
                    "model": self.model_name, "choices": choices}
            if usage is None and request.usage_in_every_chunk:  # vLLM's continuous_usage_stats
                usage = _usage(submitted)
            if usage is not None:
                body["usage"] = usage
            return _sse(body)

        echo = request.echo_text
        for index in range(request.n):  # the role first, before any token is ready (then any echo)
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
            if echo:
                yield chunk([{"index": index, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}])
        finished: set[int] = set()
        # With tool calls to parse, each choice's text so far goes through its streamer, which
        # says what to send (content, a call's header, argument fragments).
        streams = {i: StreamedChoice(plan.parser, echo) for i in range(request.n)} \
            if plan.parses_tool_calls else {}
        # With a reasoning parser, each choice's text is split first; its content goes on as above.
        reasonings = {i: ReasoningStream(self.reasoning, prompt_text) for i in range(request.n)} \
            if self.reasoning is not None else {}
        async for _, output in _stream_outputs(submitted, wait_for_disconnect):
            if isinstance(output, OpenAIError):
                yield _sse(output.body())
                break
            if request.prompt_logprobs is not None and output.prompt_logprobs is not None:
                # vLLM's: the prompt's log-probabilities once, in a chunk of their own.
                yield _sse({"id": submitted.request_id, "object": "chat.completion.chunk",
                            "created": submitted.created, "model": self.model_name, "choices": [],
                            "prompt_logprobs": self._prompt_logprobs_body(output.prompt_logprobs,
                                                                          request.prompt_logprobs)})
            for c in output.outputs:
                if c.index in finished:
                    continue
                new_ids = c.delta_token_ids
                logprobs = None
                if request.logprobs and new_ids:
                    logprobs = self._chat_logprobs(new_ids, _delta_logprobs(c), request)
                final = c.finish_reason is not None
                deltas, content = [], c.delta_text
                if c.index in reasonings:
                    reasoning, content = reasonings[c.index].update(c.delta_text, final)
                    if reasoning and request.include_reasoning:
                        deltas.append({"reasoning": reasoning, "reasoning_content": reasoning})
                if c.index in streams:
                    deltas += streams[c.index].update(content, final)
                elif content:
                    deltas.append({"content": content})
                if logprobs is not None and not deltas:
                    deltas = [{"content": ""}]
                for delta in deltas:
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
                    logprobs = None
                if c.finish_reason is not None:
                    finished.add(c.index)
                    called = c.index in streams and streams[c.index].streamer.has_tool_calls
                    yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                  "finish_reason": finish_reason(c.finish_reason, called)}])
        else:
            if request.include_usage_in_stream:
                yield chunk([], _usage(submitted))
        yield "data: [DONE]\n\n"

    def _chat_logprobs(self, token_ids, logprobs, request: ChatCompletionRequest) -> dict:
        k = request.top_logprobs or 0
        content = []
        for token, lps in zip(token_ids, logprobs or []):
            text = self._token_text(token)
            content.append({
                "token": text, "logprob": lps.get(token), "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t_text := self._token_text(t)), "logprob": lp, "bytes": list(t_text.encode("utf-8"))}
                    for t, lp in _top(lps, k)
                ],
            })
        return {"content": content}

    def _prompt_logprobs_body(self, prompt_logprobs, k: int) -> list | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}}, the prompt's own token and the top k (rank 1 is the likeliest)."""
        if prompt_logprobs is None:
            return None
        body = []
        for lps in prompt_logprobs:
            if lps is None:
                body.append(None)
                continue
            ranked = {t: r for r, (t, _) in enumerate(_top(lps, k), start=1)}
            body.append({str(t): {"logprob": lp, "rank": ranked.get(t), "decoded_token": self._token_text(t)}
                         for t, lp in lps.items()})
        return body

    def _log_request(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> None:
        shown = ""
        if self.max_log_len is not None:
            text = " | ".join(self.tokenizer.decode(ids) for ids in prompts)
            shown = f", prompt {text[:self.max_log_len]!r}"
        constraint = params.structured_outputs.kind if params.structured_outputs is not None else None
        fields = dataclasses.asdict(dataclasses.replace(params, structured_outputs=None))
        logger.info("request %s: %d prompt(s) of %s tokens, constraint %s, params %s%s", request_id, len(prompts),
                    [len(ids) for ids in prompts], constraint, fields, shown)

    # ---- /tokenize, /detokenize --------------------------------------------------------------
    def tokenize(self, request: TokenizeRequest) -> dict:
        """vLLM's /tokenize: the prompt's token ids (a conversation's through the chat template)."""
        self._check_optional_model(request.model)
        if request.messages is not None:
            conversation = [m.as_template_dict() for m in request.messages]
            tools = [t.as_template_dict() for t in request.tools or []] or None
            kwargs = self._template_kwargs(request)
            try:
                ids = apply_chat_template(self.tokenizer, conversation, request.add_generation_prompt, tools=tools,
                                          continue_final_message=request.continue_final_message,
                                          chat_template=request.chat_template or self.chat_template,
                                          template_kwargs=kwargs)
            except (ValueError, TypeError) as exc:
                raise bad_request(str(exc), "messages") from None
        else:
            ids = list(self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, request: DetokenizeRequest) -> dict:
        self._check_optional_model(request.model)
        vocab_size = self.engine.engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "tokens")
        return {"prompt": self.tokenizer.decode(request.tokens)}

    def _check_optional_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                              param="model", code="model_not_found")

    # ---- shared -------------------------------------------------------------------------------
    def _check_model(self, request: SamplingRequest) -> None:
        if request.model != self.model_name:
            raise OpenAIError(404, f"the model '{request.model}' does not exist; this server serves "
                              f"'{self.model_name}'", param="model", code="model_not_found")

    def _kept_length(self, num_prompt_tokens: int, keep: int | None) -> int:
        """The prompt's length once the engine applies truncate_prompt_tokens (`keep`)."""
        if not isinstance(keep, int) or keep == 0 or keep < -1:  # SamplingParams refuses these
            return num_prompt_tokens
        return min(num_prompt_tokens, self.max_model_len if keep == -1 else keep)

    def _room(self, num_prompt_tokens: int) -> int:
        """How many tokens can follow a prompt in the context."""
        return self.max_model_len - num_prompt_tokens

    def _check_room(self, num_prompt_tokens: int, max_tokens: int, field: str) -> None:
        """OpenAI's and vLLM's rule: the prompt and max_tokens together fit in the context (the
        engine alone would stop the reply at max_model_len instead). A prompt that leaves no
        room at all is the engine's to refuse, naming the prompt."""
        room = self._room(num_prompt_tokens)
        if 0 < room < max_tokens:
            raise bad_request(
                f"'{field}' is {max_tokens}, but the prompt is {num_prompt_tokens} tokens and max_model_len is "
                f"{self.max_model_len}: at most {room} tokens can follow it; lower '{field}' or shorten the prompt",
                field, "context_length_exceeded")

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def _submit(self, prefix: str, prompts: list[list[int]], params: SamplingParams, names: Names,
                      cache_salt: str | None = None, request_id: str | None = None) -> _Submitted:
        """Queue one engine request per prompt, in one go and all or none (the engine admits
        them together, before its next step, or none of them); with `cache_salt`, each prompt
        goes as a TokensPrompt dict carrying it. `request_id`: the client's (X-Request-Id)."""
        submitted = _Submitted(f"{prefix}-{request_id or uuid.uuid4().hex}", int(time.time()), [], [])
        if self.log_requests:
            self._log_request(submitted.request_id, prompts, params)
        request_ids = ([submitted.request_id] if len(prompts) == 1
                       else [f"{submitted.request_id}-{p}" for p in range(len(prompts))])
        if cache_salt is not None:
            prompts = [{"prompt_token_ids": ids, "cache_salt": cache_salt} for ids in prompts]
        try:
            submitted.streams = await self.engine.add_requests(
                [(request_id, prompt, params) for request_id, prompt in zip(request_ids, prompts)])
        except RequestError as exc:
            raise request_error_to_openai(exc, names) from None
        except QueueFullError as exc:
            self._on_reject("queue_full")
            raise OpenAIError(503, f"{exc}; retry later", code="queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStoppedError as exc:
            self._on_reject("shutting_down")
            raise OpenAIError(503, str(exc), code="shutting_down") from None
        return submitted


def _sampling_params(request: SamplingRequest, max_tokens: int, logprobs: int | None, names: Names,
                     stream: bool, prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
    try:
        params = request.sampling_params(max_tokens, logprobs, prompt_logprobs, defaults)
    except RequestError as exc:
        raise request_error_to_openai(exc, names) from None
    return dataclasses.replace(params, output_kind="delta" if stream else "final_only")


def _constrained(params: SamplingParams, request: SamplingRequest, names: Names,
                 plan: ToolPlan = NO_TOOLS) -> SamplingParams:
    """The params with the request's output constraint (response_format, structured_outputs,
    guided_*, or the grammar tool_choice forces); errors about it name the client's field."""
    try:
        constraint, field = request.structured_outputs_params()
    except RequestError as exc:
        raise request_error_to_openai(exc) from None
    if plan.constraint is not None:
        if constraint is not None:
            raise bad_request(f"{field} cannot be combined with tool_choice 'required' or a named function, which "
                              "constrain the reply themselves", field)
        constraint, field = plan.constraint, "tool_choice"
    if constraint is None:
        return params
    if field != "structured_outputs":
        names[constraint.field] = ClientName(field, f"{field} is the output constraint")
    return dataclasses.replace(params, structured_outputs=constraint)


def _delta_logprobs(completion: CompletionOutput) -> list[dict[int, float]]:
    """Log-probs of the tokens new in this output: the last len(delta_token_ids) of them, which
    in a "delta" output are all of them (and in a cumulative one, the end of the list)."""
    new = len(completion.delta_token_ids)
    return completion.logprobs[-new:] if new and completion.logprobs else []


def _top(lps: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens. The engine's dict holds the top k plus the sampled token, so
    when the sampled token is not among them it is the one that sorts last."""
    return sorted(lps.items(), key=lambda item: -item[1])[:k]


def _usage(submitted: _Submitted) -> dict:
    """OpenAI's usage block; `prompt_tokens_details.cached_tokens` counts the prompt tokens the
    prefix cache served."""
    outputs = [o for o in submitted.last_outputs if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    completion = submitted.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _failure_error(message: str) -> OpenAIError:
    """A request that failed in the engine: a constraint the output could not satisfy is the
    request's own problem (400, the constraint named), anything else the server's (500)."""
    if message.startswith(CONSTRAINT_FAILED):
        return OpenAIError(400, message, param="structured_outputs", code="constraint_failed")
    return OpenAIError(500, f"the request failed in the engine: {message}", code="engine_error")


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _all_finished(submitted: _Submitted) -> bool:
    return all(s.finished for s in submitted.streams)


async def _stream_outputs(submitted: _Submitted, wait_for_disconnect: WaitForDisconnect):
    """(prompt index, output) from all the request's streams as they come; an OpenAIError(500)
    in place of an output when one fails. The requests are aborted if the client disconnects
    or the consumer stops early (the finally), so their pages go back to the pool."""
    queue: asyncio.Queue = asyncio.Queue()
    submitted.last_outputs = [None] * len(submitted.streams)

    async def pump(p: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((p, output))
        except RequestFailedError as exc:
            await queue.put((p, _failure_error(str(exc))))
        finally:
            await queue.put((p, None))

    async def watch() -> None:
        await wait_for_disconnect()
        submitted.abort_all()

    tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(submitted.streams)]
    watcher = asyncio.create_task(watch())
    try:
        live = len(tasks)
        while live:
            p, item = await queue.get()
            if item is None:
                live -= 1
                continue
            if isinstance(item, RequestOutput):
                submitted.last_outputs[p] = item
                submitted.completion_tokens += sum(len(c.delta_token_ids) for c in item.outputs)
            yield p, item
            if isinstance(item, OpenAIError):
                return
    finally:
        watcher.cancel()
        submitted.abort_all()
        for task in tasks:
            task.cancel()


async def _collect(submitted: _Submitted, wait_for_disconnect: WaitForDisconnect) -> list[RequestOutput]:
    """The final output of every prompt (non-streamed responses)."""
    async for _, item in _stream_outputs(submitted, wait_for_disconnect):
        if isinstance(item, OpenAIError):
            raise item
    if not _all_finished(submitted) or any(o is None for o in submitted.last_outputs):
        raise OpenAIError(500, "the request ended without a result", code="engine_error")
    return submitted.last_outputs
