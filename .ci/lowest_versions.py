"""Print the lowest versions pyproject.toml admits, as pip requirements: each runtime
dependency's ``>=`` bound pinned with ``==`` (torch left out: the Makefile's TORCH_SPEC
installs it), and the ``peft`` extra's (the suite's LoRA tests run it). ``make test-lowest``
installs these and runs the suite on them."""

import re
from pathlib import Path

text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
block = re.search(r"^dependencies = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
block += re.search(r"^peft = \[(.*?)\]", text, re.MULTILINE).group(1)
for name, extras, low in re.findall(r'"([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([0-9][^",;]*)"', block):
    if name != "torch":
        print(f"{name}{extras}=={low}")
