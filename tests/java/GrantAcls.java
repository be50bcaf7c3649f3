// Grants topic ACLs on a test broker through Kafka's own Admin client.
//
// kafka-acls.sh lives in Kafka's tools jar, which the broker does not need and the suite does not
// fetch; aiokafka cannot create ACLs. Run with Java's source launcher and the broker's jars:
//   java -cp 'LIBS/*' GrantAcls.java BOOTSTRAP PRINCIPAL TOPIC OPERATION[,OPERATION...]
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.common.acl.AccessControlEntry;
import org.apache.kafka.common.acl.AclBinding;
import org.apache.kafka.common.acl.AclOperation;
import org.apache.kafka.common.acl.AclPermissionType;
import org.apache.kafka.common.resource.PatternType;
import org.apache.kafka.common.resource.ResourcePattern;
import org.apache.kafka.common.resource.ResourceType;

public class GrantAcls {
    public static void main(String[] args) throws Exception {
        if (args.length != 4) {
            System.err.println("usage: GrantAcls BOOTSTRAP PRINCIPAL TOPIC OPERATION[,OPERATION...]");
            System.exit(2);
        }
        Properties props = new Properties();
        props.put("bootstrap.servers", args[0]);
        List<AclBinding> bindings = new ArrayList<>();
        for (String operation : args[3].split(",")) {
            AclOperation op = AclOperation.fromString(operation);
            if (op == AclOperation.UNKNOWN) {
                System.err.println("unknown operation " + operation);
                System.exit(2);
            }
            bindings.add(new AclBinding(new ResourcePattern(ResourceType.TOPIC, args[2], PatternType.LITERAL),
                    new AccessControlEntry(args[1], "*", op, AclPermissionType.ALLOW)));
        }
        try (Admin admin = Admin.create(props)) {
            admin.createAcls(bindings).all().get();
        }
    }
}
