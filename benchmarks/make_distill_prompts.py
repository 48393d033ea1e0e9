"""Writes the versioned prompt sets `specdec distill` uses by default (deterministic: templates x
subjects, fixed order):

- benchmarks/distill_prompts.v1.jsonl        (ids d0000...)
- benchmarks/distill_prompts_extra.v1.jsonl  (ids e0000...; new subjects, tasks and phrasings)
- benchmarks/distill_prompts_more.v1.jsonl   (ids m0000...; other sentence shapes)

No prompt appears twice or is a bench prompt, so the held-out half of benchmarks/prompts.jsonl
measures a draft on text it never saw. `specdec distill` builds one corpus per file, so adding a
file only generates answers for it.

    python benchmarks/make_distill_prompts.py
"""

import json
from pathlib import Path

CODE_TASKS = [
    "reverses a list",
    "counts the vowels in a string",
    "finds the largest number in a list",
    "removes duplicates from a list",
    "checks whether a number is prime",
    "computes the factorial of n",
    "merges two sorted lists",
    "returns the n-th Fibonacci number",
    "flattens a nested list",
    "counts word frequencies in a text",
    "converts Celsius to Fahrenheit",
    "validates an email address",
    "sorts a dictionary by its values",
    "finds the second smallest element",
    "capitalizes every word",
    "computes the average of a list",
    "checks whether two strings are anagrams",
    "reads a text file line by line",
    "finds the greatest common divisor",
    "generates a random password",
]
CODE_TEMPLATES = [
    "Write a Python function that {task}.",
    "Show me a short JavaScript function that {task}.",
    "How would you write code that {task}? Explain briefly.",
    "Write a Python function that {task}, with a docstring and an example.",
]
CODE_QUESTIONS = [
    "What is a Python list comprehension? Give an example.",
    "What does the `yield` keyword do in Python?",
    "Explain the difference between a list and a tuple in Python.",
    "What is recursion in programming?",
    "How do I install a package with pip?",
    "What is a class in object-oriented programming?",
    "Explain what a hash table is.",
    "What is the difference between `==` and `is` in Python?",
    "How do I handle exceptions in Python?",
    "What is a REST API?",
    "Explain what Git is used for.",
    "What does SQL stand for and what is it used for?",
    "How do I create a virtual environment in Python?",
    "What is the difference between a compiler and an interpreter?",
    "Explain Big O notation simply.",
    "What is a for loop? Show an example in Python.",
    "How do I format a string in Python?",
    "What is JSON and why is it popular?",
    "Explain what a variable is to a beginner.",
    "How do I sort a list of numbers in descending order in Python?",
]
SUBJECTS = [
    "photosynthesis",
    "gravity",
    "the water cycle",
    "volcanoes",
    "earthquakes",
    "the immune system",
    "black holes",
    "the internet",
    "electricity",
    "rainbows",
    "the seasons",
    "DNA",
    "vaccines",
    "inflation",
    "the stock market",
    "democracy",
    "the Roman Empire",
    "the printing press",
    "renewable energy",
    "climate change",
    "the moon's phases",
    "sleep",
    "memory",
    "bees",
    "coral reefs",
    "the human heart",
    "machine learning",
    "blockchain",
    "solar panels",
    "recycling",
    "the French Revolution",
    "the Pyramids of Giza",
    "glaciers",
    "hurricanes",
    "antibiotics",
    "the speed of light",
    "magnets",
    "compound interest",
    "meditation",
    "the Olympic Games",
]
EXPLAIN_TEMPLATES = [
    "Explain {s} in simple terms.",
    "What is {s}?",
    "Give me three interesting facts about {s}.",
    "Why is {s} important?",
    "Explain {s} to a ten-year-old.",
    "Write a short paragraph about {s}.",
    "What are the main ideas behind {s}?",
]
CHAT = [
    "How can I get better at waking up early?",
    "What should I cook for dinner tonight?",
    "Can you recommend a good book for a long flight?",
    "How do I stay focused while studying?",
    "I have a job interview tomorrow. Any advice?",
    "What are some fun things to do on a rainy day?",
    "How can I save money on groceries?",
    "What is a good way to start running?",
    "How do I make new friends in a new city?",
    "Give me ideas for a birthday gift for my mother.",
    "How can I reduce stress at work?",
    "What are some healthy breakfast ideas?",
    "How do I keep my houseplants alive?",
    "Suggest a weekend trip idea.",
    "How can I learn a new language quickly?",
    "What should I pack for a beach vacation?",
    "How do I write a good thank-you note?",
    "How can I drink more water during the day?",
    "What is a good routine before going to bed?",
    "How do I start learning to play guitar?",
    "Tell me a joke about computers.",
    "Write a short poem about the sea.",
    "Write a haiku about autumn.",
    "Tell me a short story about a brave cat.",
    "Write a limerick about a programmer.",
    "Hi! How are you today?",
    "What can you help me with?",
    "Give me a motivational quote and explain it.",
    "What are the benefits of reading every day?",
    "How do I plan a productive week?",
]
TEXTS = [
    "The meeting was moved from Monday to Wednesday because several team members were travelling.",
    "Our new coffee shop opens at seven in the morning and offers fresh pastries baked every day.",
    "Scientists discovered a new species of frog in the rainforest, which is smaller than a coin.",
    "The city council approved a plan to build more bike lanes and plant trees along the main street.",
    "She practiced the piano every evening for a year and finally played in her first concert.",
    "The library will be closed for renovations during the summer and will reopen in September.",
    "Drinking enough water helps the body regulate temperature and keeps the skin healthy.",
    "The team lost the first match but worked hard and won the championship at the end of the season.",
    "Online shopping is convenient, but many people still enjoy visiting local stores.",
    "The museum's new exhibition shows paintings from artists who lived in the nineteenth century.",
]
REWRITE_TEMPLATES = [
    "Summarize this in one sentence: {t}",
    "Rewrite this more formally: {t}",
    "Translate to French: {t}",
    "Make this sentence simpler: {t}",
    "List the key points of this text: {t}",
    "Write a catchy headline for: {t}",
]

EXTRA_CODE_TASKS = [
    "checks whether a year is a leap year",
    "converts a number to binary",
    "finds all even numbers in a list",
    "returns the length of the longest word in a sentence",
    "counts how many times a character appears",
    "swaps the keys and values of a dictionary",
    "computes the sum of the digits of a number",
    "checks whether a list is sorted",
    "returns the intersection of two lists",
    "removes punctuation from a string",
    "computes the median of a list",
    "rotates a list by k positions",
    "finds the most common element in a list",
    "converts a string to title case",
    "splits a list into chunks of size n",
    "checks whether a string has balanced parentheses",
    "computes the power set of a list",
    "finds the missing number in a range",
    "reverses the words in a sentence",
    "converts minutes to hours and minutes",
]
EXTRA_CODE_TEMPLATES = [
    "Write a function in Python that {task}.",
    "Can you write a Python program that {task}?",
    "Implement a function that {task} and explain how it works.",
    "Write a short Python snippet that {task}.",
]
EXTRA_CODE_QUESTIONS = [
    "What is the difference between a function and a method?",
    "What does `if __name__ == '__main__':` mean?",
    "How do dictionaries work in Python?",
    "What is a lambda function in Python?",
    "Explain what an API is.",
    "What is the difference between Python 2 and Python 3?",
    "How do I read a JSON file in Python?",
    "What is unit testing and why is it useful?",
    "What is the difference between a stack and a queue?",
    "Explain what a linked list is.",
    "How do I reverse a string in Python?",
    "What are Python decorators?",
    "What is a database index?",
    "Explain the difference between HTTP and HTTPS.",
    "What is an operating system?",
    "What does a CPU do?",
    "How does a binary search work?",
    "What is the difference between RAM and storage?",
    "What is cloud computing?",
    "How do I write a while loop in Python?",
    "What is a syntax error?",
    "Explain what open source software is.",
    "What is the difference between frontend and backend?",
    "How do I comment code in Python?",
    "What is a string in programming?",
]
EXTRA_SUBJECTS = [
    "the solar system",
    "tsunamis",
    "the nervous system",
    "evolution",
    "the Renaissance",
    "the Great Wall of China",
    "wind power",
    "nuclear energy",
    "bacteria",
    "viruses",
    "the ozone layer",
    "deserts",
    "rainforests",
    "the ocean",
    "the Industrial Revolution",
    "the Cold War",
    "ancient Greece",
    "the Silk Road",
    "the human brain",
    "digestion",
    "nutrition",
    "exercise",
    "vitamins",
    "the moon landing",
    "Mars",
    "comets",
    "electric cars",
    "3D printing",
    "artificial intelligence",
    "cybersecurity",
    "social media",
    "the camera",
    "the telephone",
    "money",
    "taxes",
    "supply and demand",
    "banks",
    "photosynthesis in plants' leaves",
    "friction",
    "sound waves",
]
EXTRA_EXPLAIN_TEMPLATES = [
    "Tell me about {s}.",
    "How does {s} work?",
    "Describe {s} in a few sentences.",
    "What should everyone know about {s}?",
    "Summarize the history of {s}.",
    "What are common misconceptions about {s}?",
]
EXTRA_CHAT = [
    "What are some tips for a first-time traveler?",
    "How do I stop procrastinating?",
    "Can you suggest a simple recipe with eggs?",
    "How do I prepare for an exam in one week?",
    "What are good habits for a healthy life?",
    "How can I be more confident when speaking in public?",
    "What is a good way to learn to cook?",
    "How do I choose a good laptop?",
    "What are some easy indoor plants for beginners?",
    "How can I improve my handwriting?",
    "Give me tips for a long car trip with kids.",
    "How can I make my mornings less stressful?",
    "What are some good questions to ask in a job interview?",
    "How do I organize my desk?",
    "How can I sleep better at night?",
    "What are fun activities for a family weekend?",
    "How can I be a better listener?",
    "What should I do if I can't fall asleep?",
    "Give me ideas for a healthy lunch.",
    "How do I start a journal?",
    "How do I care for a new puppy?",
    "What is the best way to memorize vocabulary?",
    "How can I stay motivated to exercise?",
    "Write a short poem about friendship.",
    "Write a haiku about the moon.",
    "Tell me a fun fact about space.",
    "Write a two-sentence horror story.",
    "Tell me a riddle and its answer.",
    "Write a short poem about coffee.",
    "Tell me a story about a dragon who is afraid of fire.",
    "Write a short thank-you message to a teacher.",
    "Write a birthday message for a friend.",
    "Good morning! What should I do today?",
    "Write an email asking my manager for a day off.",
    "Write a product description for a water bottle.",
    "What are three ways to be kinder to yourself?",
    "How do I apologize to a friend?",
    "What is a good name for a pet fish?",
    "Suggest five names for a bakery.",
    "What can I do to relax after work?",
]
EXTRA_TEXTS = [
    "The train was delayed by two hours because of heavy snow, so many passengers missed their connections.",
    "Our school is organizing a charity run next month, and all the money will go to the local animal shelter.",
    "The new smartphone has a larger screen, a better camera and a battery that lasts two full days.",
    "Researchers found that people who walk for thirty minutes a day sleep better and feel less stressed.",
    "The bakery on the corner sells the best bread in town, and there is a queue every Saturday morning.",
    "After months of planning, the community garden finally opened, with vegetables, flowers and a small pond.",
    "The company announced that employees can work from home two days a week starting in January.",
    "Volunteers cleaned the beach on Sunday and collected more than two hundred kilograms of plastic.",
    "The film received excellent reviews for its music and acting, but some critics found it too long.",
    "Learning a musical instrument improves memory and concentration, according to several studies.",
    "The storm knocked down trees across the city, and some neighborhoods were without power for a day.",
    "Our team finished the project a week early, thanks to good planning and clear communication.",
]
EXTRA_REWRITE_TEMPLATES = [
    "Summarize: {t}",
    "Rewrite this in a friendly tone: {t}",
    "Translate into Spanish: {t}",
    "Turn this into a question: {t}",
    "Explain this to a child: {t}",
    "Correct and improve this text: {t}",
]


# The third set (ids m0000...): other sentence shapes -- code to explain, "how do I ... with <tool>",
# comparisons, causes, personal advice, shortening -- so the draft sees more than the first two sets'
# templates (the first distilled draft matched the target far better on its own corpus than on
# unseen prompts).
MORE_SNIPPETS = [
    "x = [n * 2 for n in range(5)]",
    "print(sum(range(1, 11)))",
    "words = text.split(); print(len(words))",
    "d = {'a': 1}; print(d.get('b', 0))",
    "for i, c in enumerate('abc'): print(i, c)",
    "with open('log.txt') as f: lines = f.readlines()",
    "nums.sort(reverse=True)",
    "squares = {n: n * n for n in range(4)}",
    "while n > 0: n //= 2",
    "print(' '.join(reversed(s.split())))",
    "total = 0\nfor x in items: total += x",
    "if x % 2 == 0: print('even')",
    "result = list(map(str.upper, names))",
    "evens = list(filter(lambda n: n % 2 == 0, nums))",
    "SELECT name FROM users WHERE age > 30;",
    "ls -la | grep .txt",
    "git commit -m 'fix typo'",
    "const add = (a, b) => a + b;",
    "import random; random.choice(items)",
    "try: x = int(s)\nexcept ValueError: x = 0",
    "a, b = b, a",
    "print(len(set(items)))",
    "def greet(name='world'): return f'hello {name}'",
    "matrix = [[0] * 3 for _ in range(3)]",
]
MORE_SNIPPET_TEMPLATES = [
    "Explain what this code does: {x}",
    "What is the output of this code, and why? {x}",
    "Is there a bug in this code? {x}",
]
MORE_HOWTO = [
    ("read an Excel file", "pandas"),
    ("plot a line chart", "matplotlib"),
    ("make an HTTP request", "Python"),
    ("parse a date string", "Python"),
    ("sort a list of dictionaries by a key", "Python"),
    ("remove a file", "bash"),
    ("find large files", "the Linux command line"),
    ("undo the last commit", "Git"),
    ("create a new branch", "Git"),
    ("count rows in a table", "SQL"),
    ("join two tables", "SQL"),
    ("drop missing values", "pandas"),
    ("group rows and compute averages", "pandas"),
    ("write a list to a CSV file", "Python"),
    ("generate random numbers", "NumPy"),
    ("measure how long a function takes", "Python"),
    ("read user input", "Python"),
    ("center a div", "CSS"),
    ("add an event listener to a button", "JavaScript"),
    ("copy a folder", "bash"),
]
MORE_HOWTO_TEMPLATES = ["How do I {task} with {tool}?", "What is the easiest way to {task} in {tool}?"]
MORE_PAIRS = [
    ("a virus", "a bacterium"),
    ("speed", "velocity"),
    ("an ocean", "a sea"),
    ("a meteor", "a meteorite"),
    ("a crocodile", "an alligator"),
    ("empathy", "sympathy"),
    ("a simile", "a metaphor"),
    ("a hurricane", "a tornado"),
    ("baking soda", "baking powder"),
    ("a democracy", "a republic"),
    ("a list", "a set in Python"),
    ("TCP", "UDP"),
    ("a loan", "a grant"),
    ("a fruit", "a vegetable"),
    ("an atom", "a molecule"),
    ("mass", "weight"),
    ("a frog", "a toad"),
    ("a lake", "a pond"),
    ("a debit card", "a credit card"),
    ("a planet", "a star"),
    ("a habit", "a routine"),
    ("AC", "DC current"),
]
MORE_PAIR_TEMPLATES = ["What is the difference between {a} and {b}?", "Compare {a} and {b} in a few sentences."]
MORE_CAUSES = [
    "thunder",
    "earthquakes",
    "rust",
    "hiccups",
    "the northern lights",
    "wind",
    "fog",
    "inflation",
    "acid rain",
    "muscle cramps",
    "jet lag",
    "sunburn",
    "ocean waves",
    "a rainbow",
    "the smell after rain",
    "yawning",
    "static electricity",
    "snoring",
    "leaves changing color in autumn",
    "traffic jams",
]
MORE_CAUSE_TEMPLATES = ["What causes {c}?", "Why does {c} happen? Explain briefly."]
MORE_FEELINGS = [
    "I am bored at home.",
    "I feel nervous before my exam.",
    "I can't concentrate at work today.",
    "I feel lonely since I moved.",
    "I am stressed about money.",
    "I keep waking up at night.",
    "I have too many things to do this week.",
    "I feel unmotivated to study.",
    "I ate too much sugar today.",
    "My neighbour is very noisy.",
    "I want to be more productive in the morning.",
    "I get headaches after screen time.",
]
MORE_FEELING_TEMPLATES = ["{f} What can I do?", "{f} Any advice?"]
MORE_ACTIVITIES = [
    "a hobby to start this spring",
    "a board game for four people",
    "a weekend project for beginners",
    "a podcast topic",
    "a gift for a coworker",
    "a name for my blog",
    "a healthy snack for the office",
    "a way to celebrate a small win",
    "a fun science experiment for kids",
    "a book club pick",
]
MORE_ACTIVITY_TEMPLATES = ["What is {a}? Give me a few ideas.", "Suggest {a}."]
MORE_TEXTS = [
    "Because the weather was very cold and windy, the organizers decided to move the concert indoors to the hall.",
    "Many people believe that breakfast is the most important meal of the day, although scientists still debate it.",
    "The old bridge, which was built more than a hundred years ago, will be repaired during the next two summers.",
    "Although she had never cooked before, Maria prepared a delicious dinner for her whole family on Sunday.",
    "Due to the fact that the printer was broken, we were not able to print the documents for the meeting.",
    "The students who finished their homework early were allowed to go outside and play football in the park.",
    "In the event that it rains tomorrow, the picnic will be postponed until the following weekend.",
    "Tom forgot his umbrella at home, and as a result he was completely wet when he arrived at the office.",
]
MORE_REWRITE_TEMPLATES = [
    "Make this sentence shorter: {t}",
    "Summarize in a few words: {t}",
    "Rewrite this in plain English: {t}",
    "Rewrite this as two sentences: {t}",
]


def more_prompts() -> list[dict]:
    rows = [("code", t.format(x=x)) for x in MORE_SNIPPETS for t in MORE_SNIPPET_TEMPLATES]
    rows += [("code", t.format(task=task, tool=tool)) for task, tool in MORE_HOWTO for t in MORE_HOWTO_TEMPLATES]
    rows += [("explanation", t.format(a=a, b=b)) for a, b in MORE_PAIRS for t in MORE_PAIR_TEMPLATES]
    rows += [("explanation", t.format(c=c)) for c in MORE_CAUSES for t in MORE_CAUSE_TEMPLATES]
    rows += [("chat", t.format(f=f)) for f in MORE_FEELINGS for t in MORE_FEELING_TEMPLATES]
    rows += [("chat", t.format(a=a)) for a in MORE_ACTIVITIES for t in MORE_ACTIVITY_TEMPLATES]
    rows += [("rewrite", t.format(t=text)) for text in MORE_TEXTS for t in MORE_REWRITE_TEMPLATES]
    return [{"id": f"m{i:04d}", "category": c, "split": "distill", "text": text} for i, (c, text) in enumerate(rows)]


def prompts(
    prefix: str, code_tasks, code_templates, code_questions, subjects, explain_templates, chat, texts, rewrite_templates
) -> list[dict]:
    rows = []
    rows += [("code", t.format(task=task)) for t in code_templates for task in code_tasks]
    rows += [("code", q) for q in code_questions]
    rows += [("explanation", t.format(s=s)) for s in subjects for t in explain_templates]
    rows += [("chat", c) for c in chat]
    rows += [("rewrite", t.format(t=text)) for text in texts for t in rewrite_templates]
    return [
        {"id": f"{prefix}{i:04d}", "category": c, "split": "distill", "text": text} for i, (c, text) in enumerate(rows)
    ]


SETS = {
    "distill_prompts.v1.jsonl": lambda: prompts(
        "d", CODE_TASKS, CODE_TEMPLATES, CODE_QUESTIONS, SUBJECTS, EXPLAIN_TEMPLATES, CHAT, TEXTS, REWRITE_TEMPLATES
    ),
    "distill_prompts_extra.v1.jsonl": lambda: prompts(
        "e",
        EXTRA_CODE_TASKS,
        EXTRA_CODE_TEMPLATES,
        EXTRA_CODE_QUESTIONS,
        EXTRA_SUBJECTS,
        EXTRA_EXPLAIN_TEMPLATES,
        EXTRA_CHAT,
        EXTRA_TEXTS,
        EXTRA_REWRITE_TEMPLATES,
    ),
    "distill_prompts_more.v1.jsonl": more_prompts,
}


def main() -> None:
    here = Path(__file__).parent
    seen = {json.loads(line)["text"] for line in (here / "prompts.jsonl").read_text().splitlines() if line.strip()}
    for name, build in SETS.items():
        rows = build()
        texts = [r["text"] for r in rows]
        assert len(set(texts)) == len(texts) and not seen & set(texts), f"{name}: a prompt repeats another"
        seen |= set(texts)
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{len(rows)} prompts -> {here / name}")


if __name__ == "__main__":
    main()
