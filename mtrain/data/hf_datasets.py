"""Records from a HuggingFace dataset folder: what `Dataset.save_to_disk` / `DatasetDict.save_to_disk` writes, or the
parquet shards a hub download leaves (`data/train-00000-of-00002.parquet`, `test.parquet`, `train/0000.parquet`).

The split: a DatasetDict folder holds its splits by name; a shard folder names them in file or folder names (the
hub's own convention, _split_of). The split is
data.train_split / data.eval_split. A missing column is one error naming the columns present, for the whole folder.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator


class HFDatasetError(ValueError):
    pass


def _split_of(shard: Path, root: Path) -> str:
    """The hub's names: `train-00000-of-00002.parquet` / `test.parquet` name the split in the file name (whatever
    folders hold them: `data/`, `main/`); a shard named by number alone (`train/0000.parquet`) by its folder."""
    prefix = re.split(r"[-.]", shard.name, maxsplit=1)[0]
    if not prefix.isdigit() or shard.parent == root:
        return prefix
    return shard.parent.name


def parquet_shards(root: Path, split: str) -> list[Path]:
    shards = sorted(root.rglob("*.parquet"))
    if not shards:
        return []
    chosen = [s for s in shards if _split_of(s, root) == split]
    if not chosen:
        found = sorted({_split_of(s, root) for s in shards})
        raise HFDatasetError(f"{root}: no parquet shards of split '{split}' (splits found: {found})")
    return chosen


def _check_columns(where: str, columns: list[str], keys: tuple[str, ...]) -> None:
    for key in keys:
        if key.split(".")[0] not in columns:
            raise HFDatasetError(f"{where}: missing column '{key.split('.')[0]}' (for key '{key}'); columns: {columns}")


def folder_records(root: Path, split: str, keys: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, record) of split `split` of the dataset folder `root`."""
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        try:
            import datasets
        except ImportError:
            raise HFDatasetError(f"{root} is a `datasets` save_to_disk folder, but the datasets package is not "
                                 "installed: pip install 'mtrain[datasets]'") from None
        ds = datasets.load_from_disk(str(root))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise HFDatasetError(f"{root}: no split '{split}' (splits: {sorted(ds)})")
            ds, where = ds[split], f"{root} [{split}]"
        else:
            where = str(root)
        _check_columns(where, list(ds.column_names), keys)
        for i, rec in enumerate(ds):
            yield f"{where}: row {i}", rec
        return
    shards = parquet_shards(root, split)
    if not shards:
        raise HFDatasetError(f"{root}: a folder, but neither a `datasets` save_to_disk folder (no dataset_dict.json "
                             "or state.json) nor one with .parquet shards")
    import pyarrow.parquet as pq
    for shard in shards:
        try:
            table = pq.read_table(shard)
        except Exception as e:  # pyarrow's own ArrowInvalid etc.
            raise HFDatasetError(f"{shard}: cannot read parquet: {e}") from None
        _check_columns(str(shard), table.column_names, keys)
        for i, rec in enumerate(table.to_pylist()):
            yield f"{shard}: row {i}", rec
