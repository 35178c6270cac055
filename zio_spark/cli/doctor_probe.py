"""What ``zio-spark doctor`` asks another Python: run as a script, it prints one JSON object.

``zio-spark doctor`` runs this file's text (``<python> -c <text>``; by path, its folder
would come first on ``sys.path`` and our ``queue.py`` would hide the standard library's)
with the Python that Spark's workers will run, so it must work where zio-spark is not installed
and on any pyspark: it imports nothing of zio-spark at module level, and every probe is
guarded. Spark capabilities are found by ``hasattr`` and ``inspect.signature``, never by
comparing version numbers (Databricks backports hooks under older version numbers).

``python doctor_probe.py start`` is the other job: import what Spark's streaming source
runner imports, from where it imports it (the caller puts ``pyspark.zip`` first on
``PYTHONPATH``, as Spark does), and print where pyspark came from. The caller times it.
"""

import importlib
import importlib.util
import inspect
import json
import os
import sys


def _error(e):
    return f"{type(e).__name__}: {e}"


def _module(name):
    """{"ok", "version", "path"} or {"ok": False, "error"}."""
    try:
        m = importlib.import_module(name)
    except Exception as e:  # any failure at import is the finding
        return {"ok": False, "error": _error(e)}
    return {
        "ok": True,
        "version": str(getattr(m, "__version__", "") or ""),
        "path": str(getattr(m, "__file__", "") or ""),
    }


def _capabilities():
    """Which Python data source hooks this pyspark has (see FACTS: Spark versions)."""
    caps = {
        "stream_api": False,
        "latest_offset_start_limit": False,
        "admission_control": False,
        "trigger_available_now": False,
        "report_latest_offset": False,
        "stream_arrow_writer": False,
        "arrow_writer": False,
    }
    try:
        ds = importlib.import_module("pyspark.sql.datasource")
    except Exception as e:
        caps["error"] = _error(e)
        return caps
    reader = getattr(ds, "DataSourceStreamReader", None)
    caps["stream_api"] = reader is not None and hasattr(ds, "DataSourceStreamWriter")
    if reader is not None:
        try:
            params = inspect.signature(reader.latestOffset).parameters
            caps["latest_offset_start_limit"] = "start" in params and "limit" in params
        except (TypeError, ValueError, AttributeError):
            pass
    try:
        sds = importlib.import_module("pyspark.sql.streaming.datasource")
    except Exception:
        sds = None
    limit = reader is not None and hasattr(reader, "getDefaultReadLimit")
    caps["admission_control"] = hasattr(sds, "ReadMaxRows") and limit
    caps["trigger_available_now"] = hasattr(sds, "SupportsTriggerAvailableNow")
    caps["report_latest_offset"] = reader is not None and hasattr(reader, "reportLatestOffset")
    caps["stream_arrow_writer"] = hasattr(ds, "DataSourceStreamArrowWriter")
    caps["arrow_writer"] = hasattr(ds, "DataSourceArrowWriter")
    return caps


def _zip_state(path):
    """Where Spark's workers import pyspark from (its bytecode is precompile's business:
    ``python -m zio_spark.cli.precompile --check``)."""
    return {"path": path, "exists": os.path.isfile(path)}


def _pyspark():
    info = _module("pyspark")
    if not info["ok"]:
        return info
    try:
        from pyspark.version import __version__

        info["version"] = str(__version__)
    except Exception:
        pass
    home = os.environ.get("SPARK_HOME") or os.path.dirname(info["path"])
    try:
        from pyspark.find_spark_home import _find_spark_home

        home = _find_spark_home()
    except BaseException:  # it calls sys.exit when it finds nothing
        pass
    lib = os.path.join(home, "python", "lib")
    info["spark_home"] = home
    info["zip"] = _zip_state(os.path.join(lib, "pyspark.zip"))
    try:
        info["py4j_zips"] = sorted(
            os.path.join(lib, n) for n in os.listdir(lib) if n.startswith("py4j-")
        )
    except OSError:
        info["py4j_zips"] = []
    info["capabilities"] = _capabilities()
    return info


def _zmq():
    try:
        import zmq
    except Exception as e:
        return {"ok": False, "error": _error(e)}
    return {
        "ok": True,
        "version": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
        "draft": bool(zmq.has("draft") and getattr(zmq, "DRAFT_API", False)),
    }


def probe():
    return {
        "executable": sys.executable,
        "python": ".".join(map(str, sys.version_info[:3])),
        "zio_spark": _module("zio_spark"),
        "pyarrow": _module("pyarrow"),
        "pyspark": _pyspark(),
        # What Spark's data source lookup imports: if it raises, Spark skips *every*
        # Python data source and the user sees only DATA_SOURCE_NOT_FOUND.
        "pyspark_zio": _module("pyspark_zio"),
        "zmq": _zmq(),
    }


def start():
    """The streaming runner's imports, then our data source module (its ``pyspark_*``)."""
    importlib.import_module("pyspark.sql.streaming.python_streaming_source_runner")
    importlib.import_module("pyspark_zio")
    pyspark = sys.modules["pyspark"]
    return {"pyspark": str(getattr(pyspark, "__file__", ""))}


if __name__ == "__main__":
    job = sys.argv[1] if len(sys.argv) > 1 else "probe"
    result = start() if job == "start" else probe()
    sys.stdout.write(json.dumps(result) + "\n")
