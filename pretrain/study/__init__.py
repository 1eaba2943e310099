"""The ZeRO x data-loading study: a grid of real `pretrain` launches, each point one `TrainConfig`, and its report.

    study run configs/study/cpu-tiny.yaml --out studies/cpu-tiny && study report studies/cpu-tiny

- `grid.py`: a grid file -> its points (validated TrainConfigs), their ids and labels.
- `runner.py`: the sweep: shard-set prep, one `pretrain --config point.yaml` launch per point, classification.
- `results.py`: metrics -> rows, results.csv, finished points, `rebuild_report`.
- `report.py`: report.md (tables and recommendations); `plots.py`: the PNGs (matplotlib).
- `cli.py`: the `study` command (`study run`, `study report`).
"""
