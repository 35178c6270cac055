package zio.spark.example;

import java.util.LinkedHashMap;
import java.util.Map;

import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.streaming.StreamingQuery;
import org.apache.spark.sql.streaming.StreamingQueryProgress;
import org.apache.spark.sql.streaming.Trigger;

import zio.spark.ZioPythonRegistration;

/**
 * Reads a ZIO flow with {@code spark.readStream().format("zio")} from plain Java and drains
 * what the producers have with {@code Trigger.AvailableNow()}.
 *
 * <p>There is no zio-spark JVM code on the classpath: Spark resolves {@code "zio"} to the
 * Python data source {@code pyspark_zio.DefaultSource} by itself, given the environment
 * that {@code jvm-shim/bin/zio-spark-submit} sets up (see jvm-shim/README.md).
 *
 * <pre>
 * zio-spark-submit --class zio.spark.example.ZioJavaExample zio-spark-example.jar \
 *     ENDPOINTS OUT CHECKPOINT SPOOL [option=value ...]
 * </pre>
 *
 * ENDPOINTS is the {@code endpoints} option (comma-separated producer endpoints); OUT is a
 * parquet folder, or {@code console} to print the rows instead; SPOOL is the
 * {@code spoolPath} option; any further {@code name=value} argument is another source
 * option. The last line on stdout is {@code {"rows": N}}: the rows in OUT (parquet, read
 * back through the sink's commit log), or the rows the query processed (console).
 */
public final class ZioJavaExample {
    private ZioJavaExample() {}

    public static void main(String[] args) throws Exception {
        if (args.length < 4) {
            System.err.println(
                "usage: ZioJavaExample ENDPOINTS OUT|console CHECKPOINT SPOOL [option=value ...]");
            System.exit(2);
        }
        String endpoints = args[0];
        String out = args[1];
        String checkpoint = args[2];
        String spool = args[3];
        Map<String, String> options = new LinkedHashMap<>();
        options.put("endpoints", endpoints);
        options.put("spoolPath", spool);
        for (int i = 4; i < args.length; i++) {
            int eq = args[i].indexOf('=');
            if (eq <= 0) {
                System.err.println("not an option=value argument: " + args[i]);
                System.exit(2);
            }
            options.put(args[i].substring(0, eq), args[i].substring(eq + 1));
        }

        SparkSession spark = SparkSession.builder().appName("zio-java-example").getOrCreate();
        int status = 0;
        try {
            // Fallback only (see ZioPythonRegistration): --conf spark.zio.python=/path/python
            String python = spark.conf().get("spark.zio.python", "");
            if (!python.isEmpty()) {
                ZioPythonRegistration.register(spark, python);
            }
            Dataset<Row> df = spark.readStream().format("zio").options(options).load();
            boolean console = "console".equals(out);
            StreamingQuery query = (console
                    ? df.writeStream().format("console").option("truncate", "false")
                    : df.writeStream().format("parquet").option("path", out))
                .option("checkpointLocation", checkpoint)
                .trigger(Trigger.AvailableNow())
                .start();
            query.awaitTermination();  // throws StreamingQueryException if the query failed

            long rows;
            if (console) {
                rows = 0;
                for (StreamingQueryProgress p : query.recentProgress()) {
                    rows += p.numInputRows();
                }
            } else {
                rows = spark.read().schema(df.schema()).parquet(out).count();
            }
            System.out.println("{\"rows\": " + rows + "}");
        } catch (Exception e) {
            e.printStackTrace();
            status = 1;
        } finally {
            spark.stop();
        }
        System.exit(status);
    }
}
