"""``EngineArgs``: the ``--diffusion-policy`` CLI flag (patches/README.md row 2), stored
into ``additional_config["diffusion_policy"]``."""

from __future__ import annotations

from vllm_diffusion.seams._wrapping import first_wrap


def install() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if not first_wrap(EngineArgs):
        return
    original_add_cli_args = EngineArgs.add_cli_args
    original_from_cli_args = EngineArgs.from_cli_args.__func__

    def add_cli_args(parser):
        from vllm_diffusion.architectures import ARCHITECTURES
        from vllm_diffusion.policies import POLICIES

        parser = original_add_cli_args(parser)
        group = parser.add_argument_group(
            title="vllm-diffusion",
            description="Diffusion language models (the architectures of "
                        "vllm_diffusion.architectures: " + ", ".join(sorted(ARCHITECTURES))
                        + ").")
        group.add_argument(
            "--diffusion-policy", default=None, choices=sorted(POLICIES),
            help="Decoding policy for block-diffusion models; its options go in "
                 "--additional-config (e.g. --additional-config.threshold 0.8).")
        return parser

    def from_cli_args(cls, args):
        engine_args = original_from_cli_args(cls, args)
        policy = getattr(args, "diffusion_policy", None)
        if policy is not None:
            engine_args.additional_config = {
                **(engine_args.additional_config or {}), "diffusion_policy": policy}
        return engine_args

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
