"""T5/mT5 models, the shard loader, the DeepSpeed ZeRO trainer and the study.

    pretrain --zero 2 --model t5-tiny --data shards/demo --out runs/demo
"""
