"""The bf16 accuracy table of docs/verl.md: for each estimator and bf16 case of verl_side/numerics.py, the largest
relative distance (over its 3 batches) of ours and of verl 0.9.1's advantages from the float64 serial reference on
the same bf16-rounded inputs. Run from the repo root (needs .side-envs/verl-0.9.1):

    .venv/bin/python tests/integrations/verl_accuracy_table.py
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (2, 1, 0)]  # the repo (advantages), tests/, here

from test_verl_real import SIDE, cases  # noqa: E402

from tests.helpers.side_envs import relative, side_json  # noqa: E402


def main() -> None:
    found = side_json("verl-0.9.1", str(SIDE / "numerics.py"))
    print("| case | estimator | ours | verl 0.9.1 |\n|---|---|---|---|")
    for case in ("bf16_int64", "bf16_dense_int64"):
        worst: dict[str, list[float]] = {}
        for name, mine, serial, theirs, _ in cases(found, case):
            errors = worst.setdefault(name, [0.0, 0.0])
            errors[0], errors[1] = max(errors[0], relative(mine, serial)), max(errors[1], relative(theirs, serial))
        for name, (ours_error, verl_error) in worst.items():
            print(f"| {case} | {name} | {ours_error:.2e} | {verl_error:.2e} |")


if __name__ == "__main__":
    main()
