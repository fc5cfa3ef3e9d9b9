"""What a command-line run does not print: warnings nobody can act on, adverts."""

from __future__ import annotations

#: warnings a command-line run does not print: nothing the user can act on, each caused by
#: Lightning meeting this trainer's design or by Lightning meeting torch (checked by
#: message; every other warning is printed)
QUIET_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # our loop steps the optimizer itself; the checkpoint after the step is the one a
    # resume needs (the resume tests check it), so Lightning's 14-line advice does not apply
    ("Using ModelCheckpoint with manual optimization and every_n_train_steps", UserWarning),
    # the shipped configs fix ModelCheckpoint.dirpath so that --ckpt_path last finds it:
    # before_fit says instead what is in the folder and how to resume from it
    ("Checkpoint directory .* exists and is not empty", UserWarning),
    # the evaluation's val/ and test/ values are computed from every rank's records already,
    # each row once (Evaluator.compute drops the rows a sampler repeats), so the advice to
    # sync them again, or to evaluate on one device, does not apply
    (r"It is recommended to use `self.log\('(val|test)/", UserWarning),
    (r"Using `DistributedSampler` with the dataloaders. During `trainer.(validate|test)",
     UserWarning),
    # Lightning 2.6's own use of a class and a function torch 2.13 deprecated (the second
    # printed by every rank of a run on several processes, at the first metric gather)
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (r"torch.distributed.nn.functional.all_gather is deprecated", FutureWarning),
)
QUIET_INFO = ("💡 Tip: For seamless cloud",)  #: info lines not printed (adverts)
