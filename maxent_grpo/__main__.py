"""``python -m maxent_grpo fit|validate|test --config configs/x.yaml``."""

from maxent_grpo.cli import main

if __name__ == "__main__":
    main()
