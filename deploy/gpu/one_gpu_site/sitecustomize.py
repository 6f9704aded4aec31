"""Loaded at start-up by every Python process that has this folder on ``PYTHONPATH`` (deploy/gpu/nccl_check.sh puts
it there in its one-GPU mode). A torchrun worker of an fthsdp replica group becomes a host of its own to NCCL
(``NCCL_HOSTID`` by group and local rank: NCCL refuses two ranks of one communicator on one GPU of one host) and
uses the one visible GPU (``LOCAL_RANK`` 0). The torchrun agent (no ``LOCAL_RANK``) and other processes are left
as they are."""

import os

if "LOCAL_RANK" in os.environ and "FTHSDP_REPLICA_INDEX" in os.environ:
    os.environ["NCCL_HOSTID"] = f"fthsdp-group{os.environ['FTHSDP_REPLICA_INDEX']}-rank{os.environ['LOCAL_RANK']}"
    os.environ["LOCAL_RANK"] = "0"
