"""The start checks of :class:`~maxent_grpo.rollout.vllm_server.VLLMServerEngine` (a mixin:
the engine holds ``servers``, ``model``, ``tokenizer``, ``weight_transfer``,
``probe_tolerance`` and ``_call``): each server serves one model under a name, takes weight
updates, splits a probe text as the policy's tokenizer does and, once it holds the policy's
weights, scores a probe as the policy does, before and after temperature. Every rank checks;
all fail together (:func:`_all_ok`). A server that comes back (restarted) is checked again
but for the probe (a collective), and must hold the start's :data:`SETTINGS`."""

from __future__ import annotations

import logging

import torch

from maxent_grpo.rollout.server_transfer import TRANSFERS
from maxent_grpo.rollout.server_weights import ServerError, _Server, server_command
from maxent_grpo.rollout.vllm_engine import NEUTRAL_SAMPLING
from maxent_grpo.validation import require

__all__ = ["PROBE_TEMPERATURE", "PROBE_TEXT", "SETTINGS", "ServerChecks"]

log = logging.getLogger("maxent_grpo.rollout.vllm_server")

#: the probe text of the start-up checks: letters, digits, spaces and punctuation
PROBE_TEXT = "The sum of 12 and 30 is 42. Check: 42 - 30 = 12!"

#: the temperature of the probe's sampled token (not 1, where log-probs before and after
#: temperature agree)
PROBE_TEMPERATURE = 0.5


#: a server's settings that its answers show only to the probe (``/server_info``): a server
#: that comes back must have the start's, since the probe is not repeated
SETTINGS = ("dtype", "logprobs_mode")


class ServerChecks:
    """The engine's start checks (see the module docstring)."""

    def _check_server(self, server: _Server) -> None:
        """``server.model``, the name the server serves the model under, after checking the
        routes and the tokenizer."""
        models = self._call(server, "GET", "/v1/models")
        try:
            names = [m["id"] for m in models.get("data", [])]
        except (AttributeError, KeyError, TypeError):
            raise ServerError(f"{server.url}/v1/models did not answer a model list (is it a "
                              f"vLLM server?): {str(models)[:300]}") from None
        require(len(names) == 1, f"{server.url} serves {names!r}; the engine needs one model")
        backend = TRANSFERS[self.weight_transfer]
        try:
            self._call(server, "GET", "/weight_info", timeout=30.0)
            if self.weight_transfer == "file":  # a collective's group forms at the first sync;
                # once per server process (again after a restart: harmless on a running one)
                self._call(server, "POST", "/init_weight_transfer_engine",
                           json={"init_info": {}}, timeout=60.0)
        except ServerError as err:
            raise ServerError(
                f"{server.url} cannot take weight updates ({err}): start it with "
                "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                f"'{{\"backend\": \"{backend}\"}}'"
                + (" (and maxent-grpo installed in its environment, which registers that "
                   "backend)" if backend.startswith("maxent_") else "") + ", as in:\n  "
                + server_command(transfer=self.weight_transfer)) from None
        ours = self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        out = self._call(server, "POST", "/tokenize", json={
            "model": names[0], "prompt": PROBE_TEXT, "add_special_tokens": False})
        theirs = out.get("tokens") if isinstance(out, dict) else None
        if not isinstance(theirs, list):
            raise ServerError(f"{server.url}/tokenize answered no tokens: {str(out)[:300]}")
        require(list(theirs) == list(ours),
                f"{server.url} serves {names[0]!r}, whose tokenizer splits the probe "
                f"{PROBE_TEXT!r} into {theirs}; the policy's tokenizer "
                f"({getattr(self.tokenizer, 'name_or_path', '?')}) gives {ours}: start the "
                "server on the policy's model")
        again = "restart it with the command it started with"  # every rank knows one name
        require(not server.model or names[0] == server.model,
                f"{server.url} came back serving {names[0]!r}, not {server.model!r}: {again}")
        server.model = names[0]
        settings = self._settings(server)
        require(not settings or settings["logprobs_mode"] == "processed_logprobs",
                f"{server.url} returns {settings and settings['logprobs_mode']}, not the "
                "log-probs after temperature that the trainer scores: start it with "
                "--logprobs-mode processed_logprobs")
        if server.settings is None:  # at start ({}: not told, so never compared)
            server.settings = settings or {}
        require(not settings or not server.settings or settings == server.settings,
                f"{server.url} came back with {settings}, not the start's {server.settings}: "
                f"{again}")

    def _settings(self, server: _Server) -> dict | None:
        """``server``'s :data:`SETTINGS`; None where ``/server_info`` does not tell them."""
        try:
            out = self._call(server, "GET", "/server_info", params={"config_format": "json"},
                             timeout=60.0)
            return {k: str(out["vllm_config"]["model_config"][k]) for k in SETTINGS}
        except (ServerError, KeyError, TypeError):
            return None

    def _check_again(self, server: _Server) -> None:
        """:meth:`_check_server` on a server that came back (restarted, or out of reach a
        while): one that is not as at start (another model, tokenizer, served name or
        setting) is out of use until a sync finds it passing (ServerError naming why, and
        a warning); one that does not answer is not back yet (its ServerError)."""
        try:
            self._check_server(server)
        except ValueError as err:
            server.healthy, server.paused_by_failure = False, True
            log.warning("%s came back and is out of use: %s", server.url, err)
            raise ServerError(f"{server.url} came back and is out of use: {err}") from None
        except ServerError:
            server.healthy = False
            raise

    def _check_probe(self) -> None:
        """The servers give a probe sequence the policy's log-probabilities, and the token
        they sample after it its log-probability at :data:`PROBE_TEMPERATURE` (a server
        returning log-probs before temperature, vLLM's default, would give the sampler
        correction wrong behaviour log-probs): ServerError naming the first server that
        does not. Every rank checks, and all fail together (a rank failing alone would
        leave the others waiting in the first collective of training)."""
        ids = self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()  # as in a rollout: no dropout
        try:  # the server holds the weights as they are: not a mixed precision's autocast
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                logits = self.model(input_ids=torch.tensor([ids], device=device)).logits[0]
        finally:
            self.model.train(was_training)
        logits = logits.float().cpu()
        ours = torch.log_softmax(logits[:-1], dim=-1).gather(
            -1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        next_logps = torch.log_softmax(logits[-1] / PROBE_TEMPERATURE, dim=-1)
        name = getattr(getattr(self.model, "config", None), "_name_or_path", "?")
        error = None
        try:
            for server in self.servers:
                if server.paused_by_failure or not server.healthy:
                    continue  # the first sync failed there (logged); the others serve
                out = self._call(server, "POST", "/v1/completions", json={
                    "model": server.model, "prompt": ids, "max_tokens": 1, "seed": 0,
                    "temperature": PROBE_TEMPERATURE, "ignore_eos": True, "logprobs": 0,
                    "prompt_logprobs": 0, "return_token_ids": True, **NEUTRAL_SAMPLING})
                try:
                    choice = out["choices"][0]
                    theirs = torch.tensor([row[str(t)]["logprob"] for row, t in zip(
                        choice["prompt_logprobs"][1:], ids[1:], strict=True)],
                        dtype=torch.float32)  # not a -true precision's default dtype
                    token = int(choice["token_ids"][0])
                    sampled = float(choice["logprobs"]["token_logprobs"][0])
                except (KeyError, IndexError, TypeError, ValueError) as err:
                    raise ServerError(
                        f"{server.url}/v1/completions answered the probe without its "
                        f"log-probabilities ({type(err).__name__}: {err}): "
                        f"{str(out)[:300]}") from None
                gap = float((theirs - ours).abs().max())
                if gap > self.probe_tolerance:
                    raise ServerError(
                        f"{server.url} serves {server.model!r}, which gives the probe "
                        f"log-probabilities up to {gap:.3g} away from the policy's "
                        f"({type(self.model).__name__}, {name}) after the weights were sent "
                        f"(probe_tolerance {self.probe_tolerance}): a different model, "
                        "dtype or sampler setting (start the server with the policy's --dtype)")
                gap = abs(sampled - float(next_logps[token]))
                if gap > self.probe_tolerance:
                    raise ServerError(
                        f"{server.url} gives the token it samples at temperature "
                        f"{PROBE_TEMPERATURE} a log-probability {gap:.3g} away from the "
                        f"policy's at that temperature (probe_tolerance {self.probe_tolerance})"
                        ": it returns log-probs before temperature; start it with "
                        "--logprobs-mode processed_logprobs")
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error = err
        _all_ok(error is None, device, error,
                "another rank's probe check of the vLLM servers failed (its error is in its log)")


def _all_ok(ok: bool, device: torch.device, error: Exception | None, other: str) -> None:
    """Raise on every rank when any rank failed: ``error`` where it happened, ``other``
    elsewhere."""
    flag = torch.tensor([1 if ok else 0], device=device)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not bool(flag):
        raise ServerError(other)
