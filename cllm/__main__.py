from cllm.cli import main

main()
