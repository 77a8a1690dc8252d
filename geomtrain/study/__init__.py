r"""The module-wise manifold study: many training runs that differ only in their assignment.

``geomtrain study`` trains every *variant* of a *suite* for every seed, with identical data,
schedule and hyperparameters, into ``RUNS_DIR/<variant>/s<seed>`` (a normal run folder of
:func:`geomtrain.train.train`), then writes the report into ``OUT``:

=================  ===========================================================================
``study.json``     command line, suite, variants, seeds, the shared config, environment, data
                   manifest, wall time per run
``summary.json``   per run: status, losses, ms/step, eval curve, training loss, the
                   per-evaluation diagnostics (per layer) and the direction solver's record
                   (evaluations per step, worst residual and dual gap, polished steps); per
                   variant: the table row. The figures and tables are rebuilt from this file alone.
``results.csv``    one row per variant: final and best val loss (mean, std over seeds), stable /
``results.md``     diverged (with steps), ms per step and its ratio to ``adamw`` / ``unconstrained``
``*.png``          :mod:`geomtrain.study.figures`: ``val_loss``, ``sigma_max``, ``attention``,
                   ``overhead``, ``mechanism`` (when some variant has DGram attention), ``sweep``
=================  ===========================================================================

Suites (``--suite``):

- ``presets`` (default): the six presets ``adamw, unconstrained, all-stiefel, all-dgram,
  hetero, hetero-inv`` (or ``--presets``).
- ``lr-sweep``: ``all-stiefel, hetero, hetero-inv, all-dgram`` x ``muon_lr`` in
  :data:`LR_SWEEP_VALUES`: where does DGram attention become unstable?
- ``bounded``: attention on :class:`manifolds.BoundedDGram` (``bdgram@B``, column norms
  at most ``B``, for each ``--bounds`` value) with Stiefel MLP and with DGram MLP, next to
  ``all-stiefel, all-dgram, hetero, hetero-inv``: does a scale bound remove the instability?
- ``autoassign``: the policy of :mod:`geomtrain.study.autoassign` picks a manifold per module
  group from short probe runs; its choice is then trained next to ``hetero`` and ``all-stiefel``.

``--sweep KEY=V1,V2`` runs every variant of a suite at every value of a config key. A variant at
the shared config's value keeps its plain folder name (others get ``__KEY-VALUE``), so suites
that share ``--runs-dir`` reuse each other's identical runs instead of training them twice: a
run is skipped whenever its folder already holds a finished run with the same config.

The study is **resumable**: a finished (or diverged) run whose folder holds the same config is
skipped, an interrupted one continues from its checkpoint; a folder holding a run with other
settings is an error (use another ``--out``). Ctrl-C stops after the current step; run the same
command again to continue. ``geomtrain report OUT`` rebuilds tables and figures from the runs
(or, without them, from ``summary.json``). ``geomtrain study toy --out DIR`` runs the controlled
single-layer attention demonstration (:func:`toy_attention`); ``geomtrain study overhead --out
DIR`` measures the step time of every preset and Muon solver interleaved in one process
(:func:`measure_overhead`), which a busy shared machine distorts far less than per-run timings.

Shared settings: the model's defaults (:data:`geomtrain.config.MODEL_DEFAULTS`) with
``max_iters = --iters``, ``warmup_iters = iters // 10``, ``eval_interval = iters // 20``; a
``--config FILE.toml`` and ``--set KEY=VALUE`` override them, identically for every variant.

Modules, in the order data flows through them: :mod:`~geomtrain.study.plan` (variants, suites,
the validated plan) -> :mod:`~geomtrain.study.runner` (locks, schedulers, ``study.json``) ->
:mod:`~geomtrain.study.collect` (run folders to a summary and its table) ->
:mod:`~geomtrain.study.report` (``results.*``) and :mod:`~geomtrain.study.figures` (PNGs);
beside them :mod:`~geomtrain.study.autoassign` (the probe policy), :mod:`~geomtrain.study.toy`,
:mod:`~geomtrain.study.overhead` and :mod:`~geomtrain.study.cli` (the command lines).
"""

from .cli import add_report_parser, add_study_parser, main
from .collect import collect, load_summary, make_table, read_run
from .overhead import format_overhead_table, measure_overhead
from .plan import (
    LR_SWEEP_VALUES,
    PRESET_ORDER,
    SUITES,
    StudyError,
    StudyPlan,
    Variant,
    bounded_variants,
    plan,
    preset_variants,
    shared_config,
    sweep_variants,
)
from .report import format_attention_table, format_table, report, write_report
from .runner import claim_lock, run_study
from .toy import toy_attention

__all__ = [
    "PRESET_ORDER",
    "SUITES",
    "LR_SWEEP_VALUES",
    "Variant",
    "StudyPlan",
    "StudyError",
    "preset_variants",
    "sweep_variants",
    "bounded_variants",
    "shared_config",
    "plan",
    "run_study",
    "claim_lock",
    "collect",
    "read_run",
    "make_table",
    "load_summary",
    "format_table",
    "format_attention_table",
    "write_report",
    "report",
    "toy_attention",
    "measure_overhead",
    "format_overhead_table",
    "add_study_parser",
    "add_report_parser",
    "main",
]
