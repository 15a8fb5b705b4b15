// Publishes messages with Pulsar's Java client, split into chunks.
//
// Interop peer for tests/chunking_pulsar.rs, run as a single-file program:
//
//     java -cp '<broker jars>/*' ProduceChunked.java SERVICE_URL CHUNK_BYTES [COMPRESSION]
//
// Reads one message per line of stdin, `topic<TAB>payload` or
// `topic<TAB>payload<TAB>key`, and sends each with a producer of its topic
// that has batching off and chunking on, in chunks of at most CHUNK_BYTES
// (messages no larger go whole), compressed with COMPRESSION (a Java
// `CompressionType`: NONE, the default, LZ4, ZLIB, ZSTD, SNAPPY). Prints `RESULT {"sent": N}` once the
// broker has stored every message.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.LinkedHashMap;
import java.util.Map;
import org.apache.pulsar.client.api.CompressionType;
import org.apache.pulsar.client.api.Producer;
import org.apache.pulsar.client.api.PulsarClient;
import org.apache.pulsar.client.api.TypedMessageBuilder;

public class ProduceChunked {
    public static void main(String[] args) throws Exception {
        String serviceUrl = args[0];
        int chunkBytes = Integer.parseInt(args[1]);
        CompressionType compression =
                args.length > 2 ? CompressionType.valueOf(args[2]) : CompressionType.NONE;
        int sent = 0;
        Map<String, Producer<byte[]>> producers = new LinkedHashMap<>();
        try (PulsarClient client = PulsarClient.builder().serviceUrl(serviceUrl).build()) {
            BufferedReader lines = new BufferedReader(
                    new InputStreamReader(System.in, StandardCharsets.UTF_8));
            String line;
            while ((line = lines.readLine()) != null) {
                String[] fields = line.split("\t", 3);
                Producer<byte[]> producer = producers.get(fields[0]);
                if (producer == null) {
                    producer = client.newProducer()
                            .topic(fields[0])
                            .enableBatching(false)
                            .enableChunking(true)
                            .chunkMaxMessageSize(chunkBytes)
                            .compressionType(compression)
                            .create();
                    producers.put(fields[0], producer);
                }
                TypedMessageBuilder<byte[]> message =
                        producer.newMessage().value(fields[1].getBytes(StandardCharsets.UTF_8));
                if (fields.length > 2) {
                    message = message.key(fields[2]);
                }
                message.send();
                sent++;
            }
            for (Producer<byte[]> producer : producers.values()) {
                producer.close();
            }
        }
        System.out.println("RESULT {\"sent\": " + sent + "}");
    }
}
