package zio.spark;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.TimeUnit;

import org.apache.spark.api.python.SimplePythonFunction;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.execution.datasources.v2.python.UserDefinedPythonDataSource;

/**
 * FALLBACK: registers the Python data source {@code pyspark_zio.DefaultSource} under its name
 * ({@code "zio"}) explicitly, for a JVM whose environment cannot be set up the normal way
 * ({@code jvm-shim/bin/zio-spark-submit}, or PYSPARK_PYTHON + PYTHONPATH, see README.md).
 *
 * <p><b>Uses internal, unstable Spark APIs</b> ({@code SimplePythonFunction},
 * {@code UserDefinedPythonDataSource}, the classic {@code SparkSession}); checked with Spark
 * 4.3.0 only. It may break with any Spark release; prefer the environment route.
 *
 * <p>It runs {@code pythonExec} once to pickle the class (CloudPickle pickles a class of an
 * importable module by reference, so the workers still import {@code pyspark_zio} and
 * {@code zio_spark}: the folder holding them is passed to the workers as PYTHONPATH), then
 * registers the pickled class for this session. Spark's own lookup of {@code pyspark_*}
 * modules still runs once with the environment's interpreter; when that one cannot import
 * pyspark it fails and Spark logs the failure, but the explicit registration stands.
 */
public final class ZioPythonRegistration {
    private ZioPythonRegistration() {}

    private static final String PICKLE = String.join("\n",
        "import os, sys, pyspark_zio",
        "from pyspark.serializers import CloudPickleSerializer",
        "blob = CloudPickleSerializer().dumps(pyspark_zio.DefaultSource)",
        "head = '%d.%d\\t%s\\t%s\\n' % (sys.version_info[0], sys.version_info[1],",
        "    pyspark_zio.DefaultSource.name(),",
        "    os.path.dirname(os.path.abspath(pyspark_zio.__file__)))",
        "sys.stdout.buffer.write(head.encode() + blob)",
        "sys.stdout.flush()");

    /**
     * Registers {@code pyspark_zio.DefaultSource} in {@code spark}, run by {@code pythonExec}
     * (an absolute path to an interpreter that has pyarrow, pyspark of the same release as
     * this JVM, and zio-spark). Returns the name registered ({@code "zio"}).
     */
    public static String register(SparkSession spark, String pythonExec)
            throws IOException, InterruptedException {
        Process proc = new ProcessBuilder(pythonExec, "-c", PICKLE)
            .redirectError(ProcessBuilder.Redirect.INHERIT)
            .start();
        byte[] out;
        try (InputStream in = proc.getInputStream()) {
            out = readAll(in);
        }
        if (!proc.waitFor(120, TimeUnit.SECONDS)) {
            proc.destroyForcibly();
            throw new IOException(pythonExec + " did not finish pickling pyspark_zio.DefaultSource");
        }
        if (proc.exitValue() != 0) {
            throw new IOException(pythonExec + " could not pickle pyspark_zio.DefaultSource "
                + "(exit " + proc.exitValue() + "; its stderr is above): it needs pyarrow, "
                + "pyspark and zio-spark");
        }
        int nl = indexOf(out, (byte) '\n');
        if (nl < 0) {
            throw new IOException("unexpected output from " + pythonExec);
        }
        String[] head = new String(out, 0, nl, StandardCharsets.UTF_8).split("\t", -1);
        String pythonVer = head[0];
        String name = head[1];
        String moduleDir = head[2];
        byte[] pickled = Arrays.copyOfRange(out, nl + 1, out.length);

        Map<String, String> env = new HashMap<>();
        String inherited = System.getenv("PYTHONPATH");
        env.put("PYTHONPATH", inherited == null || inherited.isEmpty()
            ? moduleDir : moduleDir + java.io.File.pathSeparator + inherited);
        SimplePythonFunction fn = new SimplePythonFunction(
            pickled, env, Collections.emptyList(), pythonExec, pythonVer,
            Collections.emptyList(), null);
        ((org.apache.spark.sql.classic.SparkSession) spark).dataSource()
            .registerPython(name, UserDefinedPythonDataSource.apply(fn));
        return name;
    }

    private static byte[] readAll(InputStream in) throws IOException {
        ByteArrayOutputStream buf = new ByteArrayOutputStream();
        byte[] chunk = new byte[8192];
        int n;
        while ((n = in.read(chunk)) > 0) {
            buf.write(chunk, 0, n);
        }
        return buf.toByteArray();
    }

    private static int indexOf(byte[] a, byte b) {
        for (int i = 0; i < a.length; i++) {
            if (a[i] == b) {
                return i;
            }
        }
        return -1;
    }
}
