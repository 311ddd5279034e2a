"""DP2Unlearning on Flower: stages A, B, C and the baselines, from run config
(docs/algorithms.md, "DP2Unlearning").

``pipeline="dp2u"`` with ``dp2u.method``:

* ``dp2u-sgd`` / ``dp2u-mlm``: stage A trains the base BM_DP from the public base with DP
  (DP-SGD on every client, or plain training on DP-MLM-rewritten text); stage B fine-tunes
  BM_DP on all records (deployed model FM, "before"); stage C restarts from BM_DP on the
  retained records only (unlearned model UM, "after"). The server keeps BM_DP and its (ε, δ).
* ``rfs-r``: retrain from the public base on the retained records (E rounds): exact
  unlearning, the gold standard every method's forget quality is measured against.
* ``ga`` / ``graddiff`` / ``kl`` / ``idk`` (PO): the non-DP deployed model (public base
  fine-tuned on all records for E rounds), then one federated unlearning round on the
  clients that hold the forget records (LoRA, ``training.forget-steps``,
  ``training.forget-lr``, sum merge).

Every stage is a Flower FedAvg run over the data clients (``dp2u.local-epochs`` per round). Models
of finished stages are cached on the server (``<model.cache-dir>/dp2u/<key>``, keyed by everything
that determines them), so a sweep over methods and ε trains each shared stage once.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from transformers import PreTrainedModel

from fedunlearn.benchmarks.tofu import generate_background_corpus
from fedunlearn.dp2u import DataShard, apply_forget_request, data_shards
from fedunlearn.evaluation.distribution import truth_ratio_distances
from fedunlearn.evaluation.tofu_metrics import forget_quality
from fedunlearn.scenarios import ClientAssignment
from fedunlearn.scenarios.tofu import TOFU_FORGET_DOMAIN, TofuScenario
from strategies.learn_pipeline import run_stage
from strategies.merge_strategy import MergeStrategy
from strategies.results import json_safe
from strategies.run_setup import RunModel, client_settings, evaluate_model, pretrained_state
from strategies.settings import RunSettings
from strategies.stage_cache import StageCache
from wire.messages import describe_model

DP_METHODS = ("dp2u-sgd", "dp2u-mlm")
UNLEARN_METHODS = ("ga", "graddiff", "kl", "idk")
RFS_R = "RFS-R (retain only, E)"
STAGE_A_SGD = "A: DP base (DP-SGD)"
STAGE_A_MLM = "A: DP base (DP-MLM)"
STAGE_B = "B: deployed FM (E′)"
STAGE_C = "C: unlearned UM (E′)"


class Dp2uPipeline:
    """One DP2Unlearning request: the stages a method needs, cached, then evaluation."""

    def __init__(self, grid: Grid, settings: RunSettings, run_model: RunModel) -> None:
        self.grid = grid
        self.settings = settings
        self.run_model = run_model
        data = run_model.scenario.data
        public = (
            tuple(range(len(data.author_qa), len(run_model.scenario.records())))
            if settings.dp2u.public_knowledge
            else ()
        )
        self.shards = data_shards(
            data, settings.dp2u.clients, settings.scenario.forget_percent, public
        )
        self.request = settings.forget_request()
        self.forget_indices: list[int] = []
        self.splits: dict[str, list[dict]] | None = None
        if self.request:  # named authors / records on named clients replace scenario.forget-percent
            self.shards = apply_forget_request(data, self.shards, self.request)
            self.forget_indices = sorted(i for sh in self.shards for i in sh.forget)
            # RunSettings allows strategy 'dp2u' on the tofu scenario only
            scenario = cast(TofuScenario, run_model.scenario)
            self.splits = scenario.evaluation_splits(self.forget_indices)
        cache_root = (
            Path(settings.model.cache_dir).expanduser() if settings.model.cache_dir else Path.cwd()
        )
        self.substrate_key = str(
            run_model.info.get("cache_key")
            or "model-" + hashlib.sha256(settings.model.path.encode()).hexdigest()[:16]
        )
        self.cache = StageCache(cache_root / "dp2u" / self.substrate_key)
        self.stages: dict[str, dict[str, Any]] = {}
        self._shell: PreTrainedModel | None = None
        self.client_config = {
            **describe_model(run_model.model, run_model.tokenizer),
            **client_settings(settings),
        }

    # ---- stages ------------------------------------------------------------------------------

    def public_base(self) -> dict[str, torch.Tensor]:
        """θ_public: the substrate's pre-trained stage (public corpus only), or model.path."""
        if self.settings.model.path:  # copies: the run's model object is reused for evaluation
            return {
                k: v.detach().to("cpu", torch.float32, copy=True)
                for k, v in self.run_model.model.state_dict().items()
            }
        return pretrained_state(self.settings, self.run_model)

    def stage(
        self,
        name: str,
        stage: str,
        start: tuple[str, dict[str, torch.Tensor]],
        rounds: int,
        config: dict[str, Any],
    ) -> tuple[str, dict[str, torch.Tensor]]:
        """Run (or load) one FedAvg stage from ``start`` = (key, weights); returns its key
        (:func:`~strategies.learn_pipeline.run_stage`, Flower's FedAvg)."""
        key, state, info = run_stage(
            self.grid,
            self.settings,
            self.cache,
            stage=stage,
            start=start,
            shards=self.shards,
            rounds=rounds,
            client_config={**self.client_config, **config},
        )
        self.stages[name] = info
        return key, state

    def public_mlm_path(self) -> str:
        """A masked LM for DP-MLM: ``dp2u.mlm-path`` or one trained on the public corpus."""
        if self.settings.dp2u.mlm_path:
            return self.settings.dp2u.mlm_path
        from fedunlearn.dp.mlm import save_masked_lm, train_masked_lm

        folder = self.cache.folder / f"public-mlm-seed{self.settings.seed}"
        if not (folder / "config.json").is_file():
            texts = generate_background_corpus(
                self.settings.seed, self.settings.substrate.background_documents
            )
            model, tokenizer = train_masked_lm(texts, seed=self.settings.seed)
            tmp = folder.with_name(folder.name + ".tmp")
            save_masked_lm(model, tokenizer, tmp)
            tmp.replace(folder)
        return str(folder)

    def dp_base(self, public: tuple[str, dict[str, torch.Tensor]]):
        s = self.settings
        config: dict[str, Any]
        if s.dp2u.method == "dp2u-sgd":
            config = {
                "dp-epsilon": s.dp2u.epsilon,
                "dp-delta": s.dp2u.delta,
                "dp-clip": s.dp2u.clip,
                "lr": s.dp2u.dp_lr,
                "batch-size": s.dp2u.dp_batch_size,
            }
            return self.stage(STAGE_A_SGD, "dp-base", public, s.dp2u.dp_rounds, config)
        config = {
            "mlm-path": self.public_mlm_path(),
            "mlm-epsilon": s.dp2u.epsilon,
            "mlm-sensitive-only": s.dp2u.mlm_sensitive_only,
            "lr": s.dp2u.lr,
            "batch-size": s.dp2u.batch_size,
            "local-epochs": s.dp2u.local_epochs,
        }
        return self.stage(STAGE_A_MLM, "mlm-base", public, s.dp2u.dp_rounds, config)

    # ---- the request -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        s = self.settings
        train = {
            "lr": s.dp2u.lr,
            "batch-size": s.dp2u.batch_size,
            "local-epochs": s.dp2u.local_epochs,
        }
        public = ("public:" + self.substrate_key, self.public_base())
        rfs = self.stage(RFS_R, "retrain", public, s.dp2u.retrain_rounds, train)
        reference = self._evaluate("RFS-R", rfs, None)
        metrics: dict[str, Any] = {"reference": reference}
        if s.dp2u.method == "rfs-r":
            deployed = self.stage("deployed (E)", "deploy", public, s.dp2u.retrain_rounds, train)
            metrics["before"] = self._evaluate("deployed", deployed, (rfs[0], reference))
            metrics["after"] = self._evaluate("RFS-R", rfs, (rfs[0], reference))
            unlearn_name = RFS_R
        elif s.dp2u.method in DP_METHODS:
            base = self.dp_base(public)
            deployed = self.stage(STAGE_B, "deploy", base, s.dp2u.finetune_rounds, train)
            unlearned = self.stage(STAGE_C, "unlearn", base, s.dp2u.finetune_rounds, train)
            metrics["base"] = self._evaluate("BM_DP", base, (rfs[0], reference))
            metrics["before"] = self._evaluate("FM", deployed, (rfs[0], reference))
            metrics["after"] = self._evaluate("UM", unlearned, (rfs[0], reference))
            unlearn_name = STAGE_C
        else:
            deployed = self.stage("deployed (E)", "deploy", public, s.dp2u.retrain_rounds, train)
            metrics["before"] = self._evaluate("deployed", deployed, (rfs[0], reference))
            state, info = self._approximate_unlearning(deployed[1])
            self.stages["unlearning round"] = info
            metrics["after"] = self._evaluate("unlearned", ("", state), (rfs[0], reference))
            unlearn_name = "unlearning round"
        rfs_info = self.stages[RFS_R]
        cost = self.stages[unlearn_name]
        return {
            "metrics": metrics,
            "dp2u": {
                "method": s.dp2u.method,
                "privacy": self._privacy(),
                "stages": {k: _stage_summary(v) for k, v in self.stages.items()},
                "cost_vs_rfs_r": {
                    "epochs_ratio": (
                        cost["rounds"] / rfs_info["rounds"] if cost["rounds"] else None
                    ),
                    "client_seconds_ratio": cost["client_seconds"] / rfs_info["client_seconds"],
                },
                "forget_truth_ratio_distances": truth_ratio_distances(
                    metrics["after"]["forget_truth_ratios"], reference["forget_truth_ratios"]
                ),
                "forget_request": [asdict(r) for r in self.request] or None,
                "shards": [
                    {
                        "private_records": len(sh.indices),
                        "public_records": len(sh.public),
                        "trained_records": len(sh.training),
                        "forget": len(sh.forget),
                    }
                    for sh in self.shards
                ],
                "data_check": self._data_check(),
            },
        }

    def _approximate_unlearning(
        self, deployed: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One federated round of GA / GradDiff / KL / IDK on the clients holding forget
        records (their retained records as local retain data), summed."""
        s = self.settings
        rng = random.Random(s.seed + 11)
        assignments = [
            ClientAssignment(
                "forget",
                TOFU_FORGET_DOMAIN,
                sh.forget,
                tuple(
                    rng.sample(sh.retained, min(s.scenario.local_retain_samples, len(sh.retained)))
                ),
            )
            for sh in self.shards
            if sh.forget
        ]
        strategy = MergeStrategy(
            merge="sum",
            assignments=assignments,
            client_config={**self.client_config, "objective": s.dp2u.method},
            role_config={"forget": {"steps": s.training.forget_steps, "lr": s.training.forget_lr}},
            node_wait_timeout=s.server.node_wait_timeout,
        )
        started = time.perf_counter()
        result = strategy.start(
            grid=self.grid,
            initial_arrays=_arrays(deployed),
            num_rounds=1,
            timeout=s.server.round_timeout,
            train_config=ConfigRecord(),
        )
        info = {
            "stage": f"unlearn ({s.dp2u.method}, LoRA, {s.training.forget_steps} steps)",
            "rounds": None,  # not epochs: training.forget-steps LoRA steps on the forget records
            "seconds": time.perf_counter() - started,
            "client_seconds": sum(float(c.get("seconds", 0.0)) for c in strategy.client_reports),
            "clients": strategy.client_reports,
            "cached": False,
        }
        return result.arrays.to_torch_state_dict(), info

    def _evaluate(
        self,
        name: str,
        model: tuple[str, dict[str, torch.Tensor]],
        reference: tuple[str, dict[str, Any]] | None,
    ) -> dict[str, Any]:
        """The scenario's metrics of ``model`` = (stage key, weights); cached next to the
        stage's weights per evaluation setting and reference (stage key "" = not cached)."""
        s = self.settings
        eval_key = StageCache.key(
            forget_percent=s.scenario.forget_percent,
            retain=s.eval.retain_samples,
            tokens=s.eval.max_new_tokens,
            reference=reference[0] if reference else None,
            # only a named request adds a field: percent-split keys stay those of earlier runs
            **({"forget": self.forget_indices} if self.request else {}),
        )
        path = self.cache.folder / model[0] / f"eval-{eval_key}.json" if model[0] else None
        if path is not None and path.is_file():
            return json.loads(path.read_text())
        metrics = evaluate_model(
            name,
            self._model(model[1]),
            self.run_model,
            s,
            reference[1] if reference else None,
            **({"splits": self.splits} if self.splits else {}),
        )
        if self.splits and reference:  # the scenario leaves FQ of custom splits to the caller
            metrics["forget_quality"] = forget_quality(
                metrics["forget_truth_ratios"], reference[1]["forget_truth_ratios"]
            )
        if path is not None:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(json_safe(metrics)))
            tmp.replace(path)
        return metrics

    def _model(self, state: dict[str, torch.Tensor]) -> PreTrainedModel:
        """A separate evaluation shell holding ``state`` (the run's own model stays as loaded)."""
        if self._shell is None:
            self._shell = copy.deepcopy(self.run_model.model)
        self._shell.load_state_dict(state)
        return self._shell

    def _privacy(self) -> dict[str, Any]:
        s = self.settings
        if s.dp2u.method == "dp2u-sgd":
            stage = self.stages[STAGE_A_SGD]
            last = stage["round_reports"][-1]["clients"]
            return {
                "mechanism": "DP-SGD (Opacus, RDP accountant, Poisson sampling)",
                "epsilon_target": s.dp2u.epsilon,
                "delta": s.dp2u.delta,
                "clip": s.dp2u.clip,
                "epsilon_spent_per_client": [c.get("epsilon_spent") for c in last],
                "epsilon_per_round": [
                    [c.get("epsilon_spent") for c in r["clients"]] for r in stage["round_reports"]
                ],
                "steps_per_round": [c.get("steps") for c in last],
                "noise_multiplier": [c.get("noise_multiplier") for c in last],
                "unit": "one QA record (an author with k records: group privacy, kε)",
            }
        if s.dp2u.method == "dp2u-mlm":
            stage = self.stages[STAGE_A_MLM]
            last = stage["round_reports"][-1]["clients"]
            return {
                "mechanism": "DP-MLM rewriting (exponential mechanism, clipped MLM logits)",
                "epsilon_per_token": s.dp2u.epsilon,
                "sensitive_only": s.dp2u.mlm_sensitive_only,
                "epsilon_per_record_max": [c.get("mlm_epsilon_max") for c in last],
                "tokens_replaced": [c.get("mlm_tokens_replaced") for c in last],
            }
        return {"mechanism": "none"}

    def _data_check(self) -> list[dict[str, Any]]:
        """Per client of the unlearning stage: did the forget records stay out of training?
        The server recomputes the digest of the retained records and compares it with what
        the client reported about the examples that reached its training loop."""
        from fedunlearn.dp2u import examples_digest
        from fedunlearn.qa_format import encode_record

        name = next(
            (n for n in (STAGE_C, RFS_R) if n in self.stages),
            None,
        )
        if name is None or not self.stages[name].get("round_reports"):
            return []
        records = self.run_model.scenario.records()
        tok = self.run_model.tokenizer
        checks = []
        for report in self.stages[name]["round_reports"][-1]["clients"]:
            position = report.get("position")
            if position is None or "examples_digest" not in report:
                continue
            shard: DataShard = self.shards[position]
            retained = [encode_record(tok, records[i]) for i in shard.retained]
            checks.append(
                {
                    "client": position,
                    "forget_records_on_client": len(shard.forget),
                    "trained_on_retained_only": report["examples_digest"]
                    == examples_digest(retained),
                }
            )
        return checks


def _arrays(state: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: v.detach().to("cpu", torch.float32) for k, v in state.items()})


def _stage_summary(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k != "round_reports"} | {
        "clients_last_round": (info.get("round_reports") or [{}])[-1].get("clients", [])
    }
